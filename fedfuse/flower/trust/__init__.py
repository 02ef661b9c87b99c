"""What the server does not take on trust: the robust setting's reply screen (``screen``), the clients' answers to
queries (``answer_screen``), differential privacy (``privacy``: Flower's DP wrappers, the account) and secure sums
(``secure_sum``: SecAgg+ for the head round's statistics).
"""
