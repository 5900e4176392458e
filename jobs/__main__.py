"""`python -m jobs run|status|verify|resolve …`: the job's command line."""

from jobs.reconcile import cli

cli()
