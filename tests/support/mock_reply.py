"""TEST-ONLY: a train reply as the strategy reads it (``Message``-like: content, source node, no error), without a
Flower run identity."""

from unittest.mock import Mock

from flwr.app import Message


def mock_reply(content, node_id: int = 3) -> Mock:
    """A reply of node ``node_id`` holding ``content`` (a ``RecordDict``)."""
    msg = Mock(spec=Message)
    msg.metadata = Mock(src_node_id=node_id)
    msg.has_error.return_value = False
    msg.content = content
    return msg
