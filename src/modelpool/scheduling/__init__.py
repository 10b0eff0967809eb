"""The scheduling rules, one module each, as pure functions over read-only views of the
dispatcher's records (:mod:`.views`): who goes first (:mod:`.ordering`, used by the pool's
queue in :mod:`.queueing`, the daemon's fair share and the worker's in-batch scheduler),
who is admitted (:mod:`.admission`, from each run's size: :mod:`.sizes`,
:mod:`.prediction`), who yields its worker (:mod:`.preemption`), how deep a worker's queue
is (:mod:`.prefetch`) and which worker runs what (:mod:`.placement`); :mod:`.plan`
composes them into the steps of the dispatcher's schedule.

They decide and return a plan; the dispatcher (:mod:`modelpool.supervisor.dispatcher`)
applies it and owns every write. This package imports only :mod:`modelpool.shared`
(``tests/unit/test_layers.py``). See docs/scheduling.md.
"""
