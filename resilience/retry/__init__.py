"""The retry core: one logical call, from what a driver knows to what the caller gets, in three modules.

Read them in this order (each name has one import path, its module's: this
file defines and re-exports nothing): ``spec`` (what a driver says, and the
rules decided from that alone), ``call`` (``RetryCall``, the sans-IO
decision object, and the rest of the rules), ``retrier`` (``Retrier``: the
loops with real I/O). The parts a call consults (policy, deadline, backoff,
breaker, budget, events, outcome) are the library's top-level modules.
"""
