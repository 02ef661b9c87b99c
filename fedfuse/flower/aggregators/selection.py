"""``strategy='auto'``: every round, build a few candidate aggregations and keep the one the clients score best.

Why: which aggregation wins depends on the regime, and the regime moves within a run. Measured on stock Flower's
own MNIST-1D splits (``docs/multi-round.md``): with long local training the round's clients drift apart and a
fusion (FedDF's ensemble distillation into the average, arXiv 2006.07242) beats their average by 5–10 points in the
first rounds, while a few rounds later the clients start from a good global model, their ensemble is no better
than their average and the same fusion loses; FedAvgM's server momentum (arXiv 1909.06335) speeds up some runs
and stalls others. None of the label-free signals we measured (disagreement ``KL(ensemble ‖ average)``, entropies)
tells these cases apart; the clients' own data does: the sample-weighted accuracy of a candidate over the nodes
tracked its test accuracy in every measured round. So each round:

1. the clients train and reply as usual (validated by ``RoundProtocol``);
2. the server builds ``candidates`` (names, in order of preference on a tie):
   ``"fedavg"`` — the plain weighted average (momentum restarted when it is chosen),
   ``"average"`` — the weighted average with the server momentum step,
   any same-architecture ``fedfuse.fusion`` method (``"feddf"``, ``"kf-gradient"``, ...) with its default options
   (one that reads the clients' importance scores, e.g. ``"kf-linear"``, gets them: the clients are asked to send
   them, as that method's own strategy asks); a candidate that cannot be built is skipped and recorded. Fusion candidates are built only when the clients
   train at least ``fusion_min_epochs`` local epochs a round (``local_epochs`` given; 10 by default): with 1 local
   epoch FedDF wins the clients' vote for ~17 of 30 rounds and the run ends 10 points below FedAvg on the anchor
   splits at α = 0.1 (each chosen model is better that round, but a worse start for the next one), while from
   10 local epochs its early-round wins carry to the end;
3. when a fusion candidate was built beside another candidate (one candidate, as one-shot's with the head round: no
   choice, so no query), one ``query.score_candidates`` message (``fedfuse.flower.aggregators.candidates``) to the
   round's valid clients asks each for every candidate's accuracy on its own data; the server keeps the highest
   sample-weighted accuracy. A round without a fusion candidate (short local training: the clients agree) takes
   the first array candidate at the cost of the average, with no query: on the anchor splits at 1 local epoch the
   per-round vote between the average with and without momentum tied plain FedAvg at α = 0.5 and stalled one seed
   of three at α = 0.1 (7 points below FedAvg after the head round), and the query cost 60 × the average
   (``docs/multi-round.md``).

Cost: in rounds with a fusion candidate, the candidates' fusions, plus one extra message carrying ``k`` models to each of the round's clients and
``k`` forward passes over each client's data. When no client answers, the first candidate is kept with a WARNING
and the round records it (``select-fallback``). ``info``: ``select-choice``, ``select-accuracy`` (per candidate),
``select-clients``, ``select-skipped``, ``select-query`` (whether the clients were asked), ``select-build-seconds``
(the candidates) and ``select-query-seconds`` (the clients' scoring exchange).
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Any, Iterable, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn

from fedfuse.flower.aggregators.candidates import score_candidates
from fedfuse.flower.aggregators.fusion_strategy import FusionAggregator, FusionConcerns
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.fusion import FusionError, fuse_result
from fedfuse.fusion.refine import DistillRefineOptions
from fedfuse.fusion.registry import parse_options
from fedfuse.models import levels
from fedfuse.strategy_specs import (ARRAY_CANDIDATES, AUTO_FUSION_EPOCHS, DEFAULT_CANDIDATES, MEAN_METHODS, SPECIAL_SPECS,
                                    check_candidates)

QUERY_TIMEOUT = 600.0   # seconds the scoring query waits for the round's clients
FUSION_MIN_EPOCHS = AUTO_FUSION_EPOCHS  # fusion candidates only from this many local epochs a round (the registry's)


class SelectionStrategy(RoundProtocol):
    """Per round, the candidate aggregation with the best sample-weighted accuracy on the clients' own data.

    Args:
        candidates: the aggregations tried every round (see the module docstring), first = preferred on a tie and
            kept when no client scores.
        query_timeout: seconds the scoring query waits.
        candidate_refine: ``{candidate: DistillRefineOptions fields}``: that fusion candidate's model is distilled
            from the clients' ensemble on the fusion set (``fuse(..., refine='distill', refine_options=...)``) before
            it is scored; one-shot's kf-linear with the head round (``fedfuse.plan.auto_candidate_refine``).
        one_shot: the run has one round, so a one-shot-only method (``stack``) may be the only candidate
            (``fedfuse.plan.auto_candidates``).
        Everything else: ``FusionStrategy``'s options (the held aggregator's: ``server_momentum`` is the ``"average"``
            candidate's; and the protocol's).
    """

    method = "auto"

    def __init__(self, method: str | None = None, *, candidates: Iterable[str] = DEFAULT_CANDIDATES,
                 local_epochs: int | None = None, fusion_min_epochs: int = FUSION_MIN_EPOCHS,
                 query_timeout: float = QUERY_TIMEOUT, candidate_refine: Mapping[str, Mapping[str, Any]] | None = None,
                 one_shot: bool = False, **options: Any) -> None:
        entry = options.pop("registry_entry", SPECIAL_SPECS["auto"])
        options.setdefault("guard", False)   # the clients' scores replace the guard
        concerns = FusionConcerns.take(options)
        super().__init__(**options)
        # the held aggregator: the candidates' options, the server momentum of the ``average`` candidate
        self.aggregator = FusionAggregator(self, method, concerns, registry_entry=entry)
        self.method = self.aggregator.method
        self.candidates = check_candidates(candidates, one_shot=one_shot)
        if self.model_fn is None:
            raise ValueError("strategy 'auto': needs model_fn (the candidates are scored as models)")
        self.query_timeout = float(query_timeout)
        self.candidate_refine = self._check_refine(candidate_refine or {})
        self._grid: Grid | None = None
        self._refined: dict[str, dict] = {}   # this round's candidate_refine diagnostics
        if int(fusion_min_epochs) < 0:
            raise ValueError(f"strategy 'auto': fusion_min_epochs must be >= 0, got {fusion_min_epochs}")
        # fusion candidates only after long local training (see the module docstring); None: always
        self.fusion_off = (None if local_epochs is None or int(local_epochs) >= int(fusion_min_epochs) else
                           f"local epochs {local_epochs} < {fusion_min_epochs} (strategy-options.auto-fusion-epochs)")
        # a fusion set only where a fusion candidate is built: a run whose every round averages needs none
        needs_data = [c for c in self.candidates if c not in ARRAY_CANDIDATES and self._method_spec(c).needs_data]
        if needs_data and self.fusion_inputs is None and not self.fusion_off:
            raise ValueError(f"strategy 'auto': candidates {needs_data} need fusion_inputs (the server fusion set)")
        if self.fusion_off and all(c not in ARRAY_CANDIDATES for c in self.candidates):
            raise ValueError(f"strategy 'auto': every candidate is a fusion and fusion is off here: {self.fusion_off}")
        # fusion off and the plain average first: every round is FedAvg's, so no momentum velocity to keep (the
        # round then costs what the average does); one round (one-shot): no next step for a velocity to carry into
        self._tracks_momentum = not one_shot and not (self.fusion_off and self._first_array() not in MEAN_METHODS)
        # the fusion candidates that read the clients' importance scores (kf-linear, ...): the clients send them, as
        # they would to that method's own strategy, and the candidate is built with them
        self._score_readers = tuple(c for c in self.candidates if c not in ARRAY_CANDIDATES
                                    and self._method_spec(c).reads_client_scores(None))
        if self.wants_client_scores:
            self.aggregator.level_widths = {lv.name: lv.width for lv in levels(self.model_fn())}

    def _check_refine(self, refine: Mapping[str, Mapping[str, Any]]) -> dict[str, DistillRefineOptions]:
        """``candidate_refine`` checked: fusion candidates of this strategy, valid distillation options."""
        out = {}
        for name, options in refine.items():
            if name not in self.candidates or name in ARRAY_CANDIDATES:
                raise ValueError(f"strategy 'auto': candidate_refine names {name!r}, which is not one of the fusion "
                                 f"candidates {[c for c in self.candidates if c not in ARRAY_CANDIDATES]}")
            out[name] = parse_options("distill", DistillRefineOptions, options,
                                      what=f"strategy 'auto': candidate_refine[{name!r}]")
        if out and self.fusion_inputs is None:
            raise ValueError(f"strategy 'auto': candidate_refine {sorted(out)} distils on the server fusion set; "
                             "needs fusion_inputs")
        return out

    @property
    def wants_client_scores(self) -> bool:
        """Whether the clients send importance scores: a fusion candidate reads them and fusion is on."""
        return bool(self._score_readers) and self.importance == "client" and not self.fusion_off

    def summary(self) -> None:
        log(INFO, "\t├── fedfuse auto: candidates %s, chosen per round by the clients' accuracy on their data when a "
            "fusion candidate is built%s", ", ".join(self.candidates),
            f" (fusion candidates off: {self.fusion_off}; every round takes {self._first_array()!r})"
            if self.fusion_off else "")
        super().summary()

    def _first_array(self) -> str | None:
        return next((c for c in self.candidates if c in ARRAY_CANDIDATES), None)

    def round_summary(self, server_round: int) -> str:
        return "auto(" + "|".join(self.candidates) + ")"

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._grid = grid   # the scoring query of this round goes through the same grid
        return super().configure_train(server_round, arrays, config, grid)

    def streaming_round(self, server_round: int) -> bool:
        return False   # every client model is needed (fusion candidates)

    # ---------------------------------------------------------------- the round
    def aggregate(self, server_round: int, updates: list[ClientUpdate]):
        t0 = time.perf_counter()
        rd = self.round_data(server_round, updates)
        average = self.weighted_average(updates)   # once: the base of both array candidates
        teachers: list[nn.Module] = []              # the client models, built when a fusion candidate needs them
        velocity = self.momentum_step.snapshot()
        built, after = {}, None
        self._refined = {}
        # fusion off: no vote, so only the first array candidate is built
        skipped = {c: self.fusion_off for c in self.candidates if self.fusion_off and c not in ARRAY_CANDIDATES}
        for name in [self._first_array()] if self.fusion_off else self.candidates:
            if name not in ARRAY_CANDIDATES and not teachers:
                teachers = [self.build_model(u.state) for u in updates]
            try:
                built[name] = self._candidate(name, server_round, updates, average, teachers, rd)
            except FusionError as exc:
                skipped[name] = str(exc)
                log(WARNING, "auto: round %d: candidate %r skipped: %s", server_round, name, exc)
            if name in MEAN_METHODS:
                after = self.momentum_step.swap(velocity)   # the candidate's step, undone until it is chosen
        if not built:
            raise FusionError(f"strategy 'auto': no candidate could be built: {skipped}")
        names = list(built)
        # the clients vote when a fusion candidate was built and there is a choice to make: not with array candidates
        # only (the clients agree), nor with one candidate (one-shot's sole candidate: nothing to choose, and the
        # query would send its model to every client before the head round sends it again)
        query = len(names) > 1 and any(n not in ARRAY_CANDIDATES for n in names)
        t_query = time.perf_counter()
        accuracy, clients = (self._score(server_round, updates, [built[n] for n in names]) if query
                             else (None, 0))
        seconds = {"select-build-seconds": t_query - t0, "select-query-seconds": time.perf_counter() - t_query}
        if accuracy is None:
            choice = names[0]
            if query:
                log(WARNING, "auto: round %d: no client scored the candidates; keeping %r", server_round, choice)
        else:   # the best score; the earlier candidate on a tie
            choice = names[max(range(len(names)), key=lambda i: (accuracy[i], -i))]
        state = built[choice]
        self._set_velocity(choice, after, state)
        info = {"select-choice": choice, "select-clients": clients, "select-query": query,
                "select-accuracy": None if accuracy is None else dict(zip(names, accuracy)),
                "select-skipped": skipped or None, "select-fallback": query and accuracy is None,
                "select-refine": self._refined or None, **seconds}
        log(INFO, "auto: round %d: %s (%s)", server_round, choice,
            ("one candidate: no query" if len(names) == 1 else "no fusion candidate: no query") if not query else
            "no client scored" if accuracy is None else
            "client-scored accuracy " + ", ".join(f"{n} {a:.4f}" for n, a in zip(names, accuracy)))
        return state, info, time.perf_counter() - t0

    def _candidate(self, name: str, server_round: int, updates: list[ClientUpdate],
                   average: dict[str, torch.Tensor], teachers: list[nn.Module], rd) -> dict[str, torch.Tensor]:
        """The state dict of candidate ``name`` (``average``: the round's weighted average)."""
        if name in ARRAY_CANDIDATES:
            if name not in MEAN_METHODS or not self.momentum_step.active:   # fedavg: no step
                return average
            model, _ = self.momentum_step(self.build_model(average), rd)
            return model.state_dict()
        scores = [u.scores for u in updates] if name in self._score_readers and self.wants_client_scores else None
        refine = self.candidate_refine.get(name)
        result = fuse_result(name, teachers, fusion_inputs=self.fusion_inputs, scores=scores,
                             weights=[u.num_examples for u in updates], device=self.device,
                             seed=self.seed + server_round, refine="distill" if refine else None,
                             refine_options=refine)
        if refine:   # what the distillation did: epochs run, the state kept (0 = the fused model), held-out KLs
            self._refined[name] = {k: v for k, v in result.info.items() if k.startswith("distill-")}
            log(INFO, "auto: round %d: %s distilled from the clients' ensemble: %s", server_round, name,
                ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in self._refined[name].items()))
        return result.model.state_dict()

    def _set_velocity(self, choice: str, after, state: dict[str, torch.Tensor]) -> None:
        """Momentum follows the chosen step: the ``average`` candidate's velocity, else restarted at the step
        just taken (``v = x_new − x``)."""
        if not self.momentum_step.active or not self._tracks_momentum:
            return
        if choice in MEAN_METHODS:
            self.momentum_step.swap(after)
        elif self._global is None:
            self.momentum_step.reset()
        else:
            self.momentum_step.restart_at(self._global.to_torch_state_dict(), state)

    def _score(self, server_round: int, updates: list[ClientUpdate], states: list[dict[str, torch.Tensor]]
               ) -> tuple[list[float] | None, int]:
        """``(sample-weighted accuracy per candidate or None, clients that answered)``."""
        if self._grid is None:
            return None, 0
        # the vote is bounded as the replies are: the weight cap, and one node one vote with the robust screen
        scores = score_candidates(self._grid, [u.node_id for u in updates], states, self.query_timeout,
                                  weight_cap=self.weight_cap, robust=self.robust_answers)
        if scores.error:   # a grid that cannot send the query: the round goes on, loudly
            log(WARNING, "auto: round %d: the scoring query failed: %s", server_round, scores.error)
            return None, 0
        if scores.capped:
            log(WARNING, "auto: round %d: scoring: sample counts capped at %g x the median: %s", server_round,
                self.weight_cap, "; ".join(f"node {n} claims {c}, weighed as {u}" for n, c, u in scores.capped))
        if scores.rejected:
            log(WARNING, "auto: round %d: scoring replies rejected: %s", server_round,
                "; ".join(f"node {n}: {why}" for n, why in scores.rejected))
        return scores.accuracy, scores.clients


__all__ = ["SelectionStrategy", "DEFAULT_CANDIDATES", "check_candidates"]
