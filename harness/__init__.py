"""What bench/ and tests/ share, belonging to neither (not installed with derivd).

bench/ scripts and the suite both import from here (bench/common.py and pytest's
`pythonpath` put the repository's root on sys.path), so neither imports the other.
`harness.history` reads what a run left (events, tables, the store's listing) and
`harness.invariants` checks it against DESIGN.md's state machine.
"""
