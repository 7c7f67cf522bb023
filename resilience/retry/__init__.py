"""The retry core: one logical call, from what a driver knows to what the caller gets, in three modules.

Read them in this order; each name has one import path, its module's
(this package file defines and re-exports nothing):

1. ``resilience.retry.spec``: what a driver says (``CallSpec`` before the
   first attempt, ``AttemptResult`` after each) and the rules decided from
   that alone: each attempt's timeouts and the call's deadlines
   (``attempt_timeouts``, ``deadline_times``), and what an attempt's result
   means (``classify``).
2. ``resilience.retry.call``: ``RetryCall``, the sans-IO decision object, and
   the steps it answers (``Send``, ``Wait``, ``AskProbe``, ``Return``,
   ``Raise``): the rules on attempts, ambiguity, the breaker and errors, next
   to the code that applies them.
3. ``resilience.retry.retrier``: ``Retrier``, which holds what calls share and
   drives a ``RetryCall`` with real I/O (``run``, ``arun``: one loop each, and
   a first-attempt success builds nothing it does not hand back).

The parts each call consults stay in their own modules, shared with the rest
of the library: ``resilience.policy`` (what the caller asked for),
``resilience.deadline``, ``resilience.backoff``, ``resilience.breaker``,
``resilience.budget``, ``resilience.events`` and ``resilience.outcome`` (what
an attempt and a call mean).
"""
