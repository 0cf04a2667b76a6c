"""Reconciliation (issue 22): find the events a provider sent that never arrived, and recover
them. :mod:`.options` says which providers and options; :mod:`.paging` walks a provider's pages
within the run's bounds; :mod:`.stripe_api` lists Stripe's events; :mod:`.run` compares with
the receipts and recovers."""
