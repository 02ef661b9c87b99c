"""Former name of ``fedfuse.flower.client_replies`` (kept so that existing imports work)."""

from fedfuse.flower.client_replies import *  # noqa: F401,F403
from fedfuse.flower.client_replies import TrainRequest, make_train_reply, read_train_message, reply_to_train  # noqa: F401
