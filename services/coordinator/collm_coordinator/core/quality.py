"""Expected quality gain of training tokens: diminishing returns, data volume and freshness.

Model (per adapter a; loss in nats of held-out eval loss):

    gain_a(T -> T + x) = k_a * ln((tau + T + x) / (tau + T))

where T is the effective number of tokens the adapter has already been trained on, x the effective
tokens of the next round, tau (`quality_token_scale`) the token scale at which returns start to
diminish, and k_a the adapter's gain coefficient. The log curve is concave: each extra token is worth
less than the previous one, so the planner spreads tokens over adapters instead of pouring them into
one. k_a starts from a prior (fitted to the calibration's quality curve of the adapter's domain when the
caller has one, else `quality_prior_gain`) and is re-estimated from every finished round, where the
observed loss drop d = eval_loss_before - eval_loss_after is compared with the drop the model predicts
for k = 1 (a shrinkage estimate: k = (sum d + k0 * w) / (sum l + w)). Older rounds weigh less: at each
new round of the adapter both sums are first multiplied by `quality_memory` (m), so the estimate follows
what rounds gain now. An adapter that learns fast at first and then saturates (a classification task
learnt in a few rounds) would otherwise keep the large coefficient of its first rounds and take every
share of training from the others for many rounds after its gains ran out.

Data volume and freshness enter through the effective tokens of one participant: a site with E useful
data tokens turns a budget of b tokens into E * (1 - exp(-b / E)) effective tokens, so repeated epochs
over a small dataset are worth less than fresh data. E counts samples that arrived since the site last
trained this adapter fully and older samples at `stale_data_weight`, times `data_tokens_per_sample`
times `data_useful_epochs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def log_gain(k: float, tau: float, trained_tokens: float, extra_tokens: float) -> float:
    """Expected loss decrease of `extra_tokens` more effective tokens after `trained_tokens`."""
    if extra_tokens <= 0 or k <= 0:
        return 0.0
    return k * math.log((tau + trained_tokens + extra_tokens) / (tau + trained_tokens))


def effective_tokens(budget_tokens: float, data_tokens: float) -> float:
    """Diminishing value of repeated passes over `data_tokens` of local data."""
    if budget_tokens <= 0 or data_tokens <= 0:
        return 0.0
    return data_tokens * (1.0 - math.exp(-budget_tokens / data_tokens))


def fit_log_gain(points: Sequence[tuple[float, float]], base_loss: float, tau: float) -> float:
    """Least-squares k of `base_loss - loss(T) = k * ln(1 + T / tau)` over measured (T, loss) points.

    Used to turn a calibration quality curve into the prior of `k`. Returns 0 for curves without gain.
    """
    num = 0.0
    den = 0.0
    for tokens, loss in points:
        if tokens <= 0:
            continue
        f = math.log1p(tokens / tau)
        num += (base_loss - loss) * f
        den += f * f
    return max(0.0, num / den) if den > 0 else 0.0


@dataclass
class AdapterQuality:
    """Running estimate for one adapter (mutable state owned by the core)."""

    prior_gain: float
    prior_weight: float
    memory: float = 1.0
    trained_tokens: float = 0.0
    sum_drop: float = 0.0
    sum_predicted: float = 0.0
    rounds_observed: int = 0

    @property
    def gain_coefficient(self) -> float:
        k = (self.sum_drop + self.prior_gain * self.prior_weight) / (self.sum_predicted + self.prior_weight)
        return max(0.0, k)

    def observe_round(
        self,
        tau: float,
        effective_tokens_trained: float,
        published: bool,
        loss_before: float | None,
        loss_after: float | None,
    ) -> None:
        """Record a finished round: the tokens it trained and, when evaluated, the drop it achieved."""
        if effective_tokens_trained > 0 and loss_before is not None and loss_after is not None:
            predicted = log_gain(1.0, tau, self.trained_tokens, effective_tokens_trained)
            self.sum_drop = self.memory * self.sum_drop + (loss_before - loss_after)
            self.sum_predicted = self.memory * self.sum_predicted + predicted
            self.rounds_observed += 1
        if published:
            self.trained_tokens += max(0.0, effective_tokens_trained)
