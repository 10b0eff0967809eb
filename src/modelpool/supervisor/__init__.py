"""The supervisor side: the pool of worker processes and what watches them.

Start at :mod:`.loop`, whose docstring draws a request's whole path. :mod:`.pool` is the
public class (:class:`~modelpool.ModelPool`); :mod:`.dispatcher` the state machine on the
one thread that owns all state; :mod:`.worker_manager`, :mod:`.spawn`, :mod:`.monitors`,
:mod:`.retries`, :mod:`.stalls` and :mod:`.worker_errors` start, watch, kill and retry
workers; :mod:`.records`, :mod:`.results`, :mod:`.streams` and :mod:`.stats` hold what it
knows; :mod:`.gpu`, :mod:`.devices`, :mod:`.preflight` and :mod:`.backend_choice` place a pool
on its hardware; :mod:`.observe`, :mod:`.tracing` and :mod:`.trace_export` report it; and
:mod:`.registry` is a pool of pools, one per model.
"""
