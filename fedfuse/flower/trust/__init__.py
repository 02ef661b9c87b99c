"""What the server does not take on trust: the screens (``screen``: the robust setting's screen of the replies, the
bounds and screens of the clients' answers to queries) and privacy (``privacy``: Flower's DP wrappers, the account,
and secure sums, SecAgg+ for the head round's statistics).
"""
