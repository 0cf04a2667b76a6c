"""The steps a delivery takes, in the order :mod:`tasks.pipeline` runs them: :mod:`.claim`
(steps 0-2: probe, fast claim, guarded claim), :mod:`.run` (step 3: the handler, under its
limits), :mod:`.record` (steps 4-5: the outcome committed, and its hooks); :mod:`.outcome`
is what each step reports. docs/workers.md argues why each effect happens once.
"""
