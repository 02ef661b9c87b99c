"""``importance="server"``: the fusion method scores the client models itself on the fusion set (captum) instead
of reading scores sent by the clients; what the fusion options must then say, checked before any round."""

from __future__ import annotations

from typing import Any

from fedfuse.fusion import FusionError


def scores_on_server(strategy) -> bool:
    """Whether the strategy's method can score the client models itself: its ``importance`` option takes a captum
    scorer (``ot``'s ``importance`` is selective OT's unit scoring, not a replacement for client scores)."""
    if not strategy._accepts_option("importance"):
        return False
    try:
        strategy.spec.parse_options({"importance": "deeplift"})
    except FusionError:
        return False
    return True


def server_importance_options(strategy, options: dict[str, Any], fusion_labels: Any) -> dict[str, Any]:
    """The fusion options with the method's ``importance`` set to the scoring it runs on the fusion set (DeepLIFT
    unless the options name one); a ``ValueError`` saying what is missing otherwise."""
    method = strategy.method
    if not strategy.uses_scores:
        raise ValueError(f"strategy: importance='server': method {method!r} uses no importance scores; "
                         "leave importance='client' (the default)")
    if not scores_on_server(strategy):
        raise ValueError(f"strategy: importance='server': method {method!r} takes its scores from the "
                         "clients only (no server-side scoring); use importance='client'")
    scoring = options.get("importance", "deeplift")
    if scoring == "client":
        raise ValueError("strategy: importance='server' conflicts with fusion option importance='client'; set "
                         "that option to 'deeplift', 'conductance' or 'uniform' (what the server computes)")
    if scoring != "uniform" and fusion_labels is None:
        raise ValueError(f"strategy: importance='server' computes {scoring} scores of every client model on the "
                         "fusion set and needs fusion_labels (the fusion set's labels, [B]); pass them, or use "
                         "importance='client' (scores from the clients)")
    out = {**options, "importance": scoring}
    strategy._check_options(out)
    return out
