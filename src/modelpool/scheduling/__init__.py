"""The scheduling rules, one module each, as functions over what they read: who goes first
(:mod:`.queueing`), who is admitted, who yields its worker (:mod:`.preemption`), how deep a
worker's queue is (:mod:`.prefetch`) and which worker runs what (:mod:`.placement`).

They decide and return a plan; the dispatcher (:mod:`modelpool.supervisor.dispatcher`)
applies it and owns every write. The daemon's fair share and the worker's in-batch scheduler
use the same ordering.
"""
