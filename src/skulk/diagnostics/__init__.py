"""Operator diagnostics: node bundle, cluster fan-out, timeline and heuristic warnings (issue 4).

Everything here reads; nothing writes state. Builders are pure functions of what they are given (state,
supervisor views, `now`) so that tests can pass fakes; only `processes`, `resources` and `cluster` touch the
operating system or the network.
"""
