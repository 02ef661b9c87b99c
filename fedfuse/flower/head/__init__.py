"""The head round: after the last round the clients send statistics of their data on the global model's features and
the server solves the classifier in closed form (``head_round``), its messages (``head_messages``) and its place in
a run (``head_step``).
"""
