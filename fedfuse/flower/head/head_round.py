"""The head round (``head-round=true``; ``fedfuse.progressive``): after the last round, the global model's classifier
solved in closed form from the clients' data.

In one-shot mode this is progressive few-round fusion with K = 2: after the one-shot round has fused the clients'
independently trained models, the server sends the fused model to every node once more; each node answers with the sufficient statistics of a ridge regression from the model's
pre-logit features to its one-hot labels (no training, no weights); the server adds them up and solves the
classifier in closed form: the ridge head centralised training on the frozen fused features would give, whatever the
label skew (Fed3R, arXiv 2406.01116; progressive fusion after FuseFL, arXiv 2410.20380). In multi-round mode it
replaces the head that FedAvg-style rounds bias towards each round's local label skew.

Query ``message_type``: ``"query.head_statistics"``; content: ``ArrayRecord`` ``"model"`` (the fused global model's
state dict). Reply: ``ArrayRecord`` ``"head-statistics"`` with ``gram-upper`` (the upper triangle of the
``[d+1, d+1]`` Gram matrix of the features with a constant 1 appended, row-major) and ``cross`` (``[d+1, C]``, the
features' per-class sums), and ``MetricRecord`` ``"metrics"`` with ``num-examples``. A model with several
classifiers (a depth tier's ``MultiExit``: ``fedfuse.progressive.head_sites``) gets one more pair per exit ``k``,
``gram-upper@<k>`` / ``cross@<k>``, and every classifier is solved; with ``check_each`` (multi-round depth tiers) the
clients score each solved classifier on its own, through it (a scoring query naming the site), and each is kept
unless it scores lower.

Width tiers (``client-tiers`` of width multipliers; ``HeadRound.run_tiers``): the query also carries every narrower
tier's model (``ArrayRecord`` ``"model@<tier>"``, the widths in the config's ``"tiers"``); each node builds them as
it builds its training model (``fedfuse.flower.tiers.client_tiers.tier_model``) and answers one more pair per tier,
``gram-upper@tier-<tier>`` / ``cross@tier-<tier>``, so every tier's classifier is solved from every node's data: the
forward passes of each tier's model over the node's data, no training (a narrow node holds the global model's
weights and one batch's activations). Each tier's solved head is kept unless the clients score that tier's model
lower with it. Width × depth tiers go the same way: every narrower width's ``MultiExit`` in the query, its exits named
in the config's ``"sites@<tier>"`` and answered as ``gram-upper@tier-<tier>/<k>``, each solved on that width's own
features and checked through it at that width (a slice of the full width's solved exit is not fitted to the narrow
width's features: measured, docs/tiers.md "Width × depth tiers").

A malformed reply (wrong shapes, non-finite numbers, a Gram matrix that does not match its sample count) is rejected
with a logged reason and the head is solved from the others; with no valid reply the model stays the global model,
with a WARNING and the reason in the round's record (``fallback``).

In a DP run (``HeadRound(privacy=...)``, ``dp-noise-multiplier`` > 0) the query carries a feature clip bound
(``dp-clip``) and the nodes answer with bounded, per-client mean statistics (``fedfuse.privacy``); the server sums
them with Gaussian noise, solves, and noises the check's pooled accuracies too, each release spent on the run's
(ε, δ) account (``record["private"]``).

Kept only if the clients agree (``check=True``, the default): one ``query.score_candidates`` message
(``fedfuse.flower.aggregators.candidates``) asks the nodes for the accuracy of the model before and after on their own data
(validation split, else training data); the solved head is kept unless it scores lower. A ridge head is not always
the better classifier: with mild label skew and short local training the trained head can be better, while under
label skew or long local training the solved head wins by far (measured: docs/multi-round.md, "The head round").
"""

from __future__ import annotations

import copy
import math
import time
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log
from torch import nn

from fedfuse.flower.trust.screen import CLASS_MEAN_THRESHOLD, cap_statistics, check_statistics, class_mean_scores
from fedfuse.flower.aggregators.candidates import score_candidates
from fedfuse.flower.head.head_messages import MESSAGE_TYPE, head_query_content, read_head_reply, tier_site
from fedfuse.flower.round.options import WEIGHT_CAP
from fedfuse.flower.trust.privacy import HeadPrivacy
from fedfuse.flower.trust.privacy import (CLIP, HEAD_TASK, PROJECTION, PROJECTION_K, TASK, SecureSumError,
                                       secure_sum)
from fedfuse.hetero import tier_name
from fedfuse.privacy import add_noise, bounded_sum, check_bounded, gaussian_accuracy_noise, raw_feature_head
from fedfuse.progressive import (HEAD_SOLVERS, HeadStatistics, copy_head, fit_temperature, head_sites, solve_classifier,
                                 with_head)

#: when the clients' loss with the kept solved head is above the model before's, the head's logits are scaled by each of
#: these factors (one more scoring query) and the factor with the lowest client loss is kept: a positive scale keeps
#: every prediction, hence the accuracy, and the loss is convex in it (why: a solved head can raise the accuracy and
#: the loss together; the case: docs/trust.md, "What the server bounds", head round)
CALIBRATION_FACTORS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2.0, 4.0)


def scale_head(model: nn.Module, factor: float, site: str = "") -> nn.Module:
    """Multiply the classifier ``site`` of ``model`` (weight and bias) by ``factor``, in place; returns the model."""
    head = head_sites(model)[site].classifier
    with torch.no_grad():
        head.weight.mul_(factor)
        if head.bias is not None:
            head.bias.mul_(factor)
    return model


class HeadQueries:
    """The head round's queries (see the module docstring): collect the nodes' statistics, solve the heads, have
    the clients check them. ``HeadRound`` adds what is solved (one model, its exits, or every width tier).

    Attributes:
        ridge: the closed-form head's ridge, per sample (``head-ridge``).
        timeout: seconds to wait for the nodes' answers.
        check: ask the nodes to score the model before and after, keep the solved head unless it scores lower.
        solvers: the closed-form heads solved from the same statistics (``fedfuse.progressive.HEAD_SOLVERS``:
            ``"ridge"``, ``"lda"``); with several (the default, ``head-solver='best'``), the clients score each one
            beside the model before in one query and the best is kept unless it scores lower than the model before;
            without the check the first is kept.
        privacy: bounded statistics (``fedfuse.flower.trust.privacy.HeadPrivacy``): the nodes send clipped, per-client
            mean statistics (``fedfuse.privacy``); in a DP run the server noises their sum and the check's pooled
            accuracies, both spent on the run's account; ``None``: the plain statistics.
        secure: the bounded statistics reach the server only as their sum (Flower's SecAgg+,
            ``fedfuse.flower.trust.privacy``; ``secure-aggregation=true``).
        weight_cap: a node's claimed sample count, in its statistics and in its scores, weighs at most this × the
            median of the answers' counts (``fedfuse.flower.trust.screen``; 0: no cap).
        robust: the robust setting (``robust=true``): statistics whose class means lie far from the other nodes'
            are dropped, and the check's scores are pooled one node, one vote (``fedfuse.flower.trust.screen``).
    """

    def __init__(self, ridge: float = 1e-3, timeout: float | None = None, check: bool = True,
                 solvers: tuple[str, ...] = HEAD_SOLVERS, privacy: HeadPrivacy | None = None,
                 secure: bool = False, weight_cap: float = WEIGHT_CAP, robust: bool = False) -> None:
        if not ridge >= 0:
            raise ValueError(f"head round: ridge must be >= 0, got {ridge}")
        unknown = [x for x in solvers if x not in HEAD_SOLVERS]
        if not solvers or unknown or len(set(solvers)) != len(solvers):
            raise ValueError(f"head round: solvers must be distinct names of {list(HEAD_SOLVERS)}, got "
                             f"{list(solvers)}")
        self.ridge, self.timeout, self.check, self.solvers = float(ridge), timeout, bool(check), tuple(solvers)
        if secure and privacy is None:
            raise ValueError("head round: secure aggregation sums bounded statistics: it needs privacy (the clip)")
        self.privacy, self.secure = privacy, bool(secure)
        if not weight_cap >= 0:
            raise ValueError(f"head round: weight_cap must be >= 0 (0 = no cap), got {weight_cap}")
        self.weight_cap, self.robust = float(weight_cap), bool(robust)

    def _collect(self, grid, content: RecordDict, widths: dict[str, int], num_classes: int,
                 record: dict[str, Any]) -> tuple[list[int], list[dict[str, HeadStatistics]]]:
        """Send the query to every node and read the valid answers (``record`` gets who was rejected and why)."""
        nodes = list(grid.get_node_ids())
        msgs = [Message(content=content, dst_node_id=n, message_type=MESSAGE_TYPE) for n in nodes]
        record.update({"queried": len(nodes), "rejected": [], "fallback": None})
        stats: list[dict[str, HeadStatistics]] = []
        senders: list[int] = []
        try:
            replies = list(grid.send_and_receive(msgs, timeout=self.timeout))
        except Exception as exc:  # noqa: BLE001 - a grid that cannot send: the model stays, loudly
            replies = []
            record["fallback"] = f"the head-statistics query failed: {type(exc).__name__}: {exc}"
        for reply in replies:
            try:
                got = read_head_reply(reply, widths, num_classes)
                # bounded statistics are clipped means; plain ones obey the identities of honest sums
                check = check_bounded if self.privacy is not None else check_statistics
                for s in got.values():
                    check(s)
                stats.append(got)
                senders.append(int(reply.metadata.src_node_id))
            except ValueError as exc:
                record["rejected"].append({"node": int(reply.metadata.src_node_id), "reason": str(exc)})
        if self.privacy is None:
            stats = cap_statistics(stats, senders, self.weight_cap, record)
            if self.robust:
                stats = self._screened(stats, senders, record)
        if record.get("capped"):
            log(WARNING, "fedfuse head round: sample counts capped at %g x the median: %s", self.weight_cap,
                "; ".join(f"node {c['node']} claims {c['claimed']}, weighed as {c['used']}" for c in record["capped"]))
        if record["rejected"]:
            log(WARNING, "fedfuse head round: replies rejected: %s",
                "; ".join(f"node {r['node']}: {r['reason']}" for r in record["rejected"]))
        record.update({"valid": len(stats), "num-examples": sum(next(iter(s.values())).num_examples for s in stats),
                       "numbers-per-reply": sum(v.numbers_sent for v in stats[0].values()) if stats else None})
        if not stats:
            record["fallback"] = record["fallback"] or (
                f"no valid head statistics from {len(nodes)} queried nodes ({len(replies)} answered): the model "
                "is kept")
            log(WARNING, "fedfuse head round: %s", record["fallback"])
        elif self.privacy is not None:   # one (noised) sum of the bounded statistics (fedfuse.privacy)
            stats = [{site: bounded_sum([s[site] for s in stats]) for site in stats[0]}]
            stats = self._noised(stats, record)
        return nodes, stats

    @staticmethod
    def _screened(stats: list[dict[str, HeadStatistics]], senders: list[int], record: dict[str, Any]
                  ) -> list[dict[str, HeadStatistics]]:
        """The robust setting: the nodes' statistics without those whose class means lie far from the others' at any
        classifier (``screen.class_mean_outliers``); each drop is in ``record["rejected"]`` with its score."""
        best: list[float | None] = [None] * len(stats)   # each node's highest score over the classifiers
        for site in stats[0] if stats else ():
            for i, score in enumerate(class_mean_scores([s[site] for s in stats])):
                if score is not None:
                    best[i] = max(score, best[i] or 0.0)
        record["class-mean-scores"] = dict(zip(senders, best))
        far = {i: v for i, v in enumerate(best) if v is not None and v > CLASS_MEAN_THRESHOLD}
        for i, score in sorted(far.items()):
            record["rejected"].append({"node": senders[i], "reason": (
                f"robust screen: its class means lie {score:.1f} x the median distance from the nodes' median "
                f"(threshold {CLASS_MEAN_THRESHOLD:g})")})
        return [s for i, s in enumerate(stats) if i not in far]

    def _noised(self, summed: list[dict[str, HeadStatistics]], record: dict[str, Any]
                ) -> list[dict[str, HeadStatistics]]:
        """The summed bounded statistics, noised and spent on the run's account in a DP run; recorded."""
        p = self.privacy
        record["private"] = {"clip": p.clip, "noise-multiplier": p.noise_multiplier,
                             "projection": None if p.projection is None else int(p.projection.shape[1])}
        if not p.noised:
            return summed
        clients = next(iter(summed[0].values())).num_examples
        eps = p.account.spend(p.noise_multiplier, clients, "head statistics")
        record["private"].update(epsilon=eps, delta=p.account.delta)
        log(INFO, "fedfuse head round: private statistics of %d nodes (clip %.4g, noise multiplier %.3g); "
            "epsilon %.3f at delta %g", clients, p.clip, p.noise_multiplier, eps, p.account.delta)
        return [{site: add_noise(s, p.noise_multiplier, p.generator) for site, s in summed[0].items()}]

    def _collect_secure(self, grid, model: nn.Module, width: int, num_classes: int, record: dict[str, Any]
                        ) -> tuple[list[int], list[dict[str, HeadStatistics]]]:
        """``secure-aggregation=true``: the nodes' bounded statistics summed by Flower's SecAgg+
        (``fedfuse.flower.trust.privacy``); the server sees the sum only."""
        p = self.privacy
        nodes = list(grid.get_node_ids())
        record.update({"queried": len(nodes), "rejected": [], "fallback": None, "secure-aggregation": True})
        config: dict[str, Any] = {TASK: HEAD_TASK, CLIP: float(p.clip), PROJECTION_K: 0}
        if p.projection is not None:
            config.update({PROJECTION_K: int(p.projection.shape[1]),
                           PROJECTION: p.projection.double().contiguous().numpy().tobytes()})
        try:
            (upper, cross), taken = secure_sum(grid, model.state_dict(), config, self.timeout)
            upper[-1] = float(taken)   # the constant's sum of squares: one per node, exactly (not its quantised sum)
            total = HeadStatistics.unpack(torch.as_tensor(upper), torch.as_tensor(cross).reshape(width + 1,
                                                                                                 num_classes), taken)
        except (SecureSumError, ValueError) as exc:
            record.update({"valid": 0, "num-examples": 0, "numbers-per-reply": None,
                           "fallback": f"secure sum failed: {exc}: the model is kept"})
            log(WARNING, "fedfuse head round: %s", record["fallback"])
            return nodes, []
        record.update({"valid": taken, "num-examples": taken, "numbers-per-reply": total.numbers_sent})
        return nodes, self._noised([{"": total}], record)

    def _solved(self, model: nn.Module, stats: list[dict[str, HeadStatistics]], sites: list[str],
                reference: tuple[torch.Tensor, torch.Tensor] | None, stat_site=lambda site: site
                ) -> tuple[dict[str, nn.Module], dict[str, dict[str, float]]]:
        """``({solver: a copy of model with every classifier of sites solved by it}, {solver: {site: temperature}})``
        (``stat_site(site)``: the replies' name of a classifier's statistics)."""
        out, temps = {}, {}
        for name in self.solvers if self.check else self.solvers[:1]:   # unchecked: the first is kept
            m, temps[name] = copy.deepcopy(model), {}
            for site in sites:
                solved = solve_classifier([s[stat_site(site)] for s in stats], name, self.ridge)
                if self.privacy is not None:   # solved on the projected features / clip: back to the model's
                    solved = raw_feature_head(solved, self.privacy.clip, self.privacy.projection)
                m = with_head(m, solved, site)
                temps[name][site] = fit_temperature(m, *reference, site=site) if reference is not None else 1.0
            out[name] = m
        return out, temps

    def _choose(self, grid, nodes: list[int], before: nn.Module, candidates: dict[str, nn.Module],
                record: dict[str, Any], tier: float | None = None, site: str | None = None,
                views: list | None = None, temps: dict[str, dict[str, float]] | None = None) -> str | None:
        """Which solved head stays (``None``: the model before): the clients score the model before and every
        candidate (``tier``: as that width tier's model; ``site``: through that classifier, a depth tier's exit); the
        best candidate stays unless it scores lower than the model before. ``record`` gets their accuracies and
        losses, the best solver and the round's federated row (of the model it keeps; ``views`` gets every row, before
        first). With ``temps`` (``{solver: {site: temperature}}``, updated), a kept head whose client loss is above the
        model before's is calibrated (``_calibrate``)."""
        names = list(candidates)
        record["solver"] = names[0]
        if not self.check:
            return names[0]
        states = [before.state_dict(), *(candidates[n].state_dict() for n in names)]
        private = None
        if self.privacy is not None and self.privacy.noised:   # the check's pooled accuracies are a release too
            p = self.privacy
            p.account.spend(p.noise_multiplier, len(nodes), "head check")
            private = (p.noise_multiplier, p.generator)
        scores = score_candidates(grid, nodes, states, self.timeout, tier=tier, site=site or None, private=private,
                                  weight_cap=self.weight_cap, robust=self.robust)
        if scores.capped:
            record["check-capped"] = [{"node": n, "claimed": c, "used": u} for n, c, u in scores.capped]
        record["rejected"] = record.get("rejected", []) + [{"node": n, "reason": f"scoring: {why}"}
                                                           for n, why in scores.rejected]
        if scores.rejected or scores.error:
            log(WARNING, "fedfuse head round: scoring: %s", scores.error or "; ".join(
                f"node {n}: {why}" for n, why in scores.rejected))
        acc = scores.accuracy
        if acc is None:
            record["client-accuracy"] = None
            log(WARNING, "fedfuse head round: no node scored the models; the solved head is kept unchecked")
            return names[0]
        top = max(acc[1:])   # ties (up to the float round-off of averaging the clients' scores): the first solver
        best = next(i for i in range(len(names)) if acc[i + 1] >= top - 1e-9)
        record["solver"] = names[best]
        record["client-accuracy"] = {"before": acc[0], "head": acc[best + 1]}
        if len(names) > 1:
            record["solver-accuracy"] = {n: acc[i + 1] for i, n in enumerate(names)}
        federated = [{"federated-accuracy": a, "federated-loss": l_, "federated-clients": scores.clients,
                      "federated-examples": scores.examples} for a, l_ in zip(acc, scores.loss)]
        margin = 0.0
        if private is not None and scores.clients:   # noised scores: keep the head only if it is clearly better
            # two standard deviations of the difference of two noised means (a worse head passes ~2 % of the time)
            margin = 2 * math.sqrt(2) * gaussian_accuracy_noise(private[0], len(states)) / scores.clients
            record["check-margin"] = margin
        keep = acc[best + 1] >= acc[0] + margin
        record["federated"] = federated[best + 1 if keep else 0]   # the clients' view of the kept model
        loss = scores.loss or []
        if len(loss) == len(acc) and all(math.isfinite(v) for v in (loss[0], loss[best + 1])):
            record["client-loss"] = {"before": loss[0], "head": loss[best + 1]}
            if keep and temps is not None and loss[best + 1] > loss[0]:
                self._calibrate(grid, nodes, candidates[names[best]], record, tier, site or "",
                                temps[names[best]], acc[0], acc[best + 1])
        if views is not None:
            views[:] = federated
        if not keep:
            which = ((f" of tier {tier_name(tier)}" if tier is not None else "")
                     + (f" of classifier {site}" if site else ""))
            if margin > 0:   # DP: noised scores; the head must beat the model before by the margin, not merely
                log(INFO, "fedfuse head round: the clients' noised scores do not show the solved head%s better by the "
                    "DP check's margin %.4f (%.4f for it vs %.4f before, %+.4f): the model before it stays", which,
                    margin, acc[best + 1], acc[0], acc[best + 1] - acc[0])
            else:
                log(INFO, "fedfuse head round: the clients score the solved head%s lower (%.4f < %.4f): the model "
                    "before it stays", which, acc[best + 1], acc[0])
        return names[best] if keep else None

    def _calibrate(self, grid, nodes: list[int], model: nn.Module, record: dict[str, Any], tier: float | None,
                   site: str, temps: dict[str, float], acc_before: float, acc_head: float) -> None:
        """The kept solved head raised the clients' loss: score it scaled by every ``CALIBRATION_FACTORS`` (one
        query; the predictions, hence the accuracy, do not change) and keep the scale with the lowest client loss
        (``model`` and ``temps[site]`` updated in place; ``record["calibration"]``). A loss still above the model
        before's is a WARNING, recorded (``record["loss-rose"]``)."""
        before, head = record["client-loss"]["before"], record["client-loss"]["head"]
        variants = [scale_head(copy.deepcopy(model), f, site) for f in CALIBRATION_FACTORS]
        scores = score_candidates(grid, nodes, [v.state_dict() for v in variants], self.timeout, tier=tier,
                                  site=site or None, weight_cap=self.weight_cap, robust=self.robust)
        losses = scores.loss if scores.accuracy is not None else None
        cal: dict[str, Any] = {"loss-at-1": head, "factor": 1.0}
        if losses is not None and all(math.isfinite(v) for v in losses):
            cal["losses"] = dict(zip((f"{f:g}" for f in CALIBRATION_FACTORS), losses))
            i = min(range(len(losses)), key=losses.__getitem__)
            if losses[i] < head:
                scale_head(model, CALIBRATION_FACTORS[i], site)
                temps[site] = temps.get(site, 1.0) * CALIBRATION_FACTORS[i]
                cal["factor"], head = CALIBRATION_FACTORS[i], losses[i]
                record["client-loss"]["head"] = head
                if isinstance(record.get("federated"), dict):
                    record["federated"] = {**record["federated"], "federated-loss": head}
        else:
            cal["error"] = scores.error or "no node scored the scaled heads"
        record["calibration"] = cal
        if head > before:
            record["loss-rose"] = {"before": before, "head": head}
            which = (f" of tier {tier_name(tier)}" if tier is not None else "") + (f" of classifier {site}" if site else "")
            log(WARNING, "fedfuse head round: the solved head%s raises the clients' loss from %.4f to %.4f (accuracy "
                "%.4f -> %.4f), even at the best of the scales %s; kept for its accuracy", which, before, head,
                acc_before, acc_head, list(CALIBRATION_FACTORS))
        else:
            log(INFO, "fedfuse head round: the solved head's logits scaled by %g: the clients' loss %.4f (%.4f before "
                "the head round, %.4f unscaled)", cal["factor"], head, before, cal["loss-at-1"])


class HeadRound(HeadQueries):
    """Server side of the head round (see the module docstring): the global model's classifier(s) or every width
    tier's, solved and checked (``HeadQueries``' options)."""

    def run(self, grid, model: nn.Module, num_classes: int, reference: tuple[torch.Tensor, torch.Tensor] | None = None,
            sites: tuple[str, ...] | None = None, check_each: bool = False) -> tuple[nn.Module, dict[str, Any]]:
        """``(model with the solved head, the round's record)``; the record's ``fallback`` says why the head was not
        replaced when no node gave valid statistics (the model is then returned unchanged). ``reference``: unlabeled
        inputs and the clients' ensemble's probabilities on them, to set the head's temperature
        (``fit_temperature``: same accuracy, a loss on the usual scale); ``None``: temperature 1. ``sites``: the
        classifiers to solve (``head_sites``; ``None``: every one). ``check_each``: with several classifiers (a depth
        tier's exits), the clients score each one on its own, through it, and each solved classifier is kept unless
        it scores lower (``record["sites"]``); else one check of the model's own output."""
        t0 = time.perf_counter()
        every = head_sites(model)
        unknown = sorted(set(sites or ()) - set(every))
        if unknown:
            raise ValueError(f"head round: the model has no classifier {unknown}; it has {sorted(every)}")
        widths = {site: s.classifier.in_features for site, s in every.items() if sites is None or site in sites}
        record: dict[str, Any] = {}
        p = self.privacy
        if p is not None and p.projection is not None:   # the statistics are of the k projected features
            widths = {site: p.projection.shape[1] for site in widths}
        if self.secure:
            if list(widths) != [""]:
                raise ValueError("head round: secure aggregation sums one classifier's statistics")
            nodes, stats = self._collect_secure(grid, model, widths[""], num_classes, record)
        else:   # the query: the model, and the bound and projection of bounded statistics
            content = head_query_content(model.state_dict(), sites, dp_clip=None if p is None else p.clip,
                                         dp_projection=None if p is None else p.projection)
            nodes, stats = self._collect(grid, content, widths, num_classes, record)
        if not stats:
            record["seconds"] = time.perf_counter() - t0
            return model, record
        solved, temps = self._solved(model, stats, list(widths), reference)
        if check_each and len(widths) > 1:
            out = self._keep_each(grid, nodes, model, solved, temps, list(widths), record)
            record["seconds"] = time.perf_counter() - t0
            log(INFO, "fedfuse head round: classifiers solved from %d nodes' statistics, kept: %s", record["valid"],
                ", ".join(f"{k}: {v['kept']} ({v['solver']})" for k, v in record["sites"].items()))
            return out, record
        chosen = self._choose(grid, nodes, model, solved, record, temps=temps)
        t = temps[chosen or record["solver"]]
        record["temperature"] = t[""] if len(t) == 1 and "" in t else t
        record["kept"] = "head" if chosen else "before"
        record["seconds"] = time.perf_counter() - t0
        if chosen:
            log(INFO, "fedfuse head round: classifier solved (%s) from %d nodes' statistics (%d samples, %.2fs)",
                chosen, len(stats), record["num-examples"], record["seconds"])
        return (solved[chosen] if chosen else model), record

    def _keep_each(self, grid, nodes: list[int], before: nn.Module, solved: dict[str, nn.Module],
                   temps: dict[str, dict[str, float]], sites: list[str], record: dict[str, Any],
                   tier: float | None = None) -> nn.Module:
        """``check_each``: every classifier's solved heads scored on their own against the model before (the
        candidates differ in that classifier only; ``tier``: as that width tier's model); a classifier the clients
        score lower keeps its trained weights. ``record`` gets ``sites`` (one row each) and the final classifier's
        check."""
        out = copy.deepcopy(before)
        record["sites"] = {}
        for site in sites:
            rec: dict[str, Any] = {}
            candidates = {n: copy_head(m, copy.deepcopy(before), site) for n, m in solved.items()}
            chosen = self._choose(grid, nodes, before, candidates, rec, tier=tier, site=site, temps=temps)
            if chosen:
                copy_head(candidates[chosen], out, site)
            record["rejected"] = record.get("rejected", []) + rec.pop("rejected", [])
            record["sites"][site or "final"] = {"kept": "head" if chosen else "before",
                                                "temperature": temps[rec["solver"]][site], **rec}
        record["temperature"] = {site: record["sites"][site or "final"]["temperature"] for site in sites}
        final = record["sites"]["final"] if "" in sites else {}
        record.update({k: final[k] for k in ("client-accuracy", "federated", "client-loss", "calibration", "loss-rose")
                       if k in final})
        kept = [v["kept"] for v in record["sites"].values()]
        record["kept"] = final["kept"] if final else ("head" if "head" in kept else "before")
        return out

    def run_tiers(self, grid, models: dict[float, nn.Module], num_classes: int,
                  reference: tuple[torch.Tensor, torch.Tensor] | None = None,
                  sites: dict[float, tuple[str, ...]] | None = None
                  ) -> tuple[dict[float, nn.Module], dict[str, Any]]:
        """Width tiers: ``({tier: its model with its solved head(s), or as it was}, the round's record)``. ``models``:
        every tier's model, the global one at tier 1; one query carries them all, every node answers for every
        tier, each tier's head is solved and checked on its own (``record["tiers"][<tier>]``); the record's
        ``kept`` / ``federated`` / ``temperature`` / ``solver`` are the global model's. ``sites``: per tier, the
        classifiers of ``head_sites`` its model has solved (a tier not named: its own, ``""``); a tier with other or
        more (width × depth tiers: the exits its nodes use, each solved on that width's own features, so a narrow
        tier stops reading a slice of the full width's exit) has each checked on its own, through it, at its width
        (``record["tiers"][<tier>]["sites"]``)."""
        t0 = time.perf_counter()
        if self.privacy is not None or self.secure:
            raise ValueError("head round: the private / secure head round takes one architecture, not width tiers")
        if 1.0 not in models:
            raise ValueError(f"head round: the tiers' models need the global one (tier 1), got {sorted(models)}")
        named = {r: tuple((sites or {}).get(r, ("",))) for r in models}
        unknown = sorted(set(sites or {}) - set(models))
        if unknown:
            raise ValueError(f"head round: classifiers named for tiers {unknown}, which have no model")
        widths: dict[str, int] = {}
        for r, model in models.items():
            every = head_sites(model)
            missing = sorted(set(named[r]) - set(every))
            if missing or not named[r]:
                raise ValueError(f"head round: tier {tier_name(r)}'s model has no classifier {missing or '(none named)'}"
                                 f"; it has {sorted(every)}")
            widths.update({_stat_name(r, site): every[site].classifier.in_features for site in named[r]})
        narrower = {r: m for r, m in models.items() if r != 1.0}
        content = head_query_content(models[1.0].state_dict(), named[1.0], {r: m.state_dict() for r, m in narrower.items()},
                                     tier_sites={r: named[r] for r in narrower if named[r] != ("",)})
        record: dict[str, Any] = {}
        nodes, stats = self._collect(grid, content, widths, num_classes, record)
        out = dict(models)
        if stats:
            record["tiers"] = {}
            for r, model in models.items():
                solved, temps = self._solved(model, stats, list(named[r]), reference,
                                             stat_site=lambda site, r=r: _stat_name(r, site))
                tier: dict[str, Any] = {}
                at = None if r == 1.0 else r
                if named[r] == ("",):
                    chosen = self._choose(grid, nodes, model, solved, tier, tier=at, temps=temps)
                    tier.update(temperature=temps[tier["solver"]][""], kept="head" if chosen else "before")
                    out[r] = solved[chosen] if chosen else model
                else:
                    out[r] = self._keep_each(grid, nodes, model, solved, temps, list(named[r]), tier, tier=at)
                record["tiers"][tier_name(r)] = tier
            record["rejected"] += [x for t in record["tiers"].values() for x in t.pop("rejected", [])]
            top = record["tiers"][tier_name(1.0)]
            record.update({k: top[k] for k in ("temperature", "kept", "federated", "client-accuracy", "solver",
                                               "client-loss", "calibration", "loss-rose", "sites") if k in top})
            log(INFO, "fedfuse head round: %d tiers' classifiers solved from %d nodes' statistics (%d samples); "
                "kept: %s",
                len(models), len(stats), record["num-examples"],
                ", ".join(f"{k}: {t['kept']} ({t.get('solver', 'per classifier')})"
                          for k, t in record["tiers"].items()))
        record["seconds"] = time.perf_counter() - t0
        return out, record


def _stat_name(r: float, site: str) -> str:
    """The replies' name of tier ``r``'s classifier ``site``: the global model's own names at tier 1."""
    return site if r == 1.0 else tier_site(r, site)


__all__ = ["CALIBRATION_FACTORS", "HeadQueries", "HeadRound", "scale_head"]
