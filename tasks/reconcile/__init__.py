"""Reconciliation (issue 22): find the events a provider sent that never arrived, and recover
them. :mod:`core.providers.reconcile_options` says which providers and options; :mod:`.paging`
walks a provider's pages within the run's bounds; :mod:`.stripe_api`, :mod:`.github_api` and
:mod:`.svix_api` list each provider's events, all through :mod:`.transport` (addresses judged
at connect time, no redirect, a size cap, a deadline per call); :mod:`.run` compares with the
receipts and recovers."""
