"""Settings of the aggregator (`COLLM_` environment variables; see CommonSettings)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from collm_common.settings import CommonSettings


class AggregatorSettings(CommonSettings):
    # Aggregation.
    strategy: Literal["product_svd", "fedavg"] = Field(
        "product_svd",
        description="How updates are combined: product_svd averages B·A and re-factorises to the same rank "
        "(exact when the average has rank <= r); fedavg averages A and B separately. See bench/README.md, "
        "Federated aggregation.",
    )
    clip_norm: float | None = Field(
        None, gt=0, description="If set, each update's change from the base is clipped to this L2 norm first."
    )
    server_lr: float | Literal["participants"] = Field(
        1.0,
        description="Server learning rate eta: the candidate is base + eta x (aggregate - base); 1 is plain "
        "averaging. 'participants': eta = the number of accepted updates, so the participants' changes add "
        "up rather than average (each domain keeps its own participant's full step; measured by "
        "`python -m collm_bench federated rounds --server-lr participants`).",
    )
    blas_threads: int | None = Field(
        1,
        ge=1,
        description="Threads of the BLAS library under the aggregation math (numpy's OpenBLAS), set once per "
        "process. 1: on a machine whose cores are busy with replicas, OpenBLAS threads spin-wait for each "
        "other and one product-SVD aggregation of SmolLM2's adapter took 1.3-8 s instead of ~0.1 s; None: "
        "the library's default (one per core).",
    )
    # Collection.
    quorum_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Built-in plans: fraction of participants whose valid updates close a round.",
    )
    round_deadline_s: float = Field(
        120.0, gt=0, description="Built-in plans: seconds from opening to deadline."
    )
    quorum_grace_s: float | None = Field(
        None,
        ge=0,
        description="Close this long after the quorum is reached (None: wait for all or the deadline).",
    )
    late_policy: Literal["drop", "staleness"] = Field(
        "drop",
        description="drop: late or older-base updates are recorded and not used; staleness: updates trained "
        "from a base up to max_staleness versions older (and late updates, carried into the adapter's next "
        "round) count with weight staleness_weight**gap.",
    )
    staleness_weight: float = Field(0.5, gt=0, le=1, description="Weight factor per version of staleness.")
    max_staleness: int = Field(
        1, ge=1, description="Largest base-version gap accepted under late_policy=staleness."
    )
    rebase_scale: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Async rounds: a round rebased onto the version an earlier round published while it "
        "collected applies this fraction of its candidate's change from its own base to that version (1: "
        "all of it; lower it where local training moves far per round). The promotion gate judges the "
        "rebased candidate against that version.",
    )
    # Validation.
    max_delta_norm: float | None = Field(
        100.0,
        gt=0,
        description="Reject updates whose change from the base has a larger L2 norm (None: no bound).",
    )
    norm_outlier_factor: float | None = Field(
        4.0,
        gt=1,
        description="With >= 3 valid updates, reject one whose change norm is > this x the others' median.",
    )
    # Federated evaluation and the promotion gate.
    eval_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for replicas' evaluation reports."
    )
    eval_max_examples: int = Field(
        32, ge=1, description="Held-out examples each replica scores per candidate."
    )
    eval_max_tokens: int | None = Field(
        1024,
        ge=1,
        description="Held-out tokens per domain each replica scores per version at most (at least one "
        "example; None: examples only). With eval_max_examples, bounds the promotion gate's work.",
    )
    eval_max_replicas: int | None = Field(
        4,
        ge=1,
        description="Replicas that score each round's versions at most: the first by name of the replicas "
        "holding the adapter's domain data, whoever trained, so the same held-out sites judge successive "
        "versions (None: every one). Each evaluation is work on a serving "
        "replica, so the cap keeps the gate's cost per round fixed as the cluster grows.",
    )
    eval_task_examples: int = Field(
        8,
        ge=0,
        le=64,
        description="Task metrics of published versions (intent accuracy, final-answer accuracy, ROUGE-L; "
        "the replicas' `task_metrics`): each evaluator generates greedy answers to this many of its first "
        "held-out examples per domain and scores them (`quality_probe`); 0: loss only.",
    )
    eval_task_interval_s: float = Field(
        300.0,
        ge=0,
        description="An adapter's published versions have their task metrics probed at most this often "
        "(the generations are served beside users' requests).",
    )
    eval_task_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait for one replica's task-metric generations."
    )
    eval_prescore_current: bool = Field(
        True,
        description="Score the current version while participants train (at the round's opening) and only "
        "the candidate after aggregation; a replica whose held-out set changed meanwhile scores both.",
    )
    gate_min_gain_nats: float = Field(
        0.001,
        description="Promotion gate: publish only a candidate whose held-out loss is lower than the "
        "current version's by at least this (nats per response token, on the same examples) plus "
        "`gate_z` standard errors; below 0 lets a worse candidate through (tests).",
    )
    gate_z: float = Field(
        2.0,
        ge=0,
        description="Promotion gate: standard errors of the paired per-example difference that the gain "
        "must clear besides `gate_min_gain_nats` (services/aggregator/README.md: the rule, measured).",
    )
    publish_without_eval: bool = Field(
        False, description="Publish when no replica could evaluate (default: hold back, the safe choice)."
    )
    # When participants send.
    publish_lead_s: float | None = Field(
        None,
        ge=0,
        description="Participants get a deadline this much earlier than the round's, so that aggregation, "
        "the candidate's evaluation and the publication fit before the round's deadline (the collection "
        "still waits until the round's deadline). None: measured, 1.25 x the longest close-to-publication "
        "time of the adapter's last 5 rounds (publish_lead_initial_s before any); 0: none.",
    )
    publish_lead_initial_s: float = Field(
        5.0, ge=0, description="The measured lead before any round has published."
    )
    publish_lead_max_frac: float = Field(
        0.25, ge=0, le=1, description="The lead is at most this fraction of the round (opening to deadline)."
    )
    # Control of participants.
    control_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of one StartTraining request to a replica."
    )
    # Built-in plan (until/unless the coordinator sends plans).
    default_plan: bool = Field(
        True, description="Run built-in plans when no coordinator plan arrived recently."
    )
    default_plan_period_s: float = Field(
        60.0, gt=0, description="Seconds between built-in rounds of an adapter."
    )
    default_plan_idle_s: float = Field(
        180.0,
        gt=0,
        description="Built-in plans start only when neither a coordinator plan nor a coordinator decision "
        "arrived for this long (counted from the aggregator's start until the first one): they stand in for "
        "a coordinator that is not running, not for one that plans nothing while SLOs are at risk.",
    )
    default_token_budget: int = Field(
        4096, ge=1, description="Built-in plans: training tokens per participant."
    )
    default_learning_rate: float = Field(1e-3, gt=0, description="Built-in plans: local learning rate.")
    default_plan_adapters: dict[str, list[str]] = Field(
        default_factory=lambda: {"shared": []},
        description='Built-in plans: adapter -> domains (JSON, e.g. {"shared": [], "math": ["math"]}; '
        "[] = any domain). Adapters in the store whose meta field 'domains' is set are planned too.",
    )
    default_plan_bootstrap: bool = Field(
        True,
        description="When an adapter of default_plan_adapters has no version yet, ask one replica with data "
        "to create its v1 (StartTraining without a round); its rounds start at the next period.",
    )
    telemetry_stale_s: float = Field(15.0, gt=0, description="Replicas silent for longer are not planned.")
    # Store and records.
    retention_versions: int = Field(
        5, ge=1, description="Adapter versions whose blobs are kept (plus current)."
    )
    rounds_kept: int = Field(1000, ge=10, description="Round records kept in Redis for `rounds list|show`.")
    update_ttl_s: int = Field(86400, ge=60, description="Lifetime of candidate blobs in the store.")
    store_outage_s: float = Field(
        120.0,
        gt=0,
        description="A round step that needs the adapter store (saving the outcome or the evaluations, "
        "storing the candidate, publishing) retries this long while Redis is unreachable (a restart); "
        "after that the round is aborted.",
    )
    consumer_name: str = Field(
        "collm-aggregator", pattern=r"^[A-Za-z0-9_-]+$", description="Durable JetStream consumer of updates."
    )
    import_roots: list[str] = Field(
        default_factory=list,
        description="Directories under which `import` may read PEFT adapters (empty: any readable path).",
    )
    supported_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Target modules an imported adapter may use (what the replica's engine can serve).",
    )
    max_import_rank: int = Field(64, ge=1, description="Largest LoRA rank accepted on import.")

    @model_validator(mode="after")
    def _check(self) -> AggregatorSettings:
        if self.default_plan_idle_s < self.default_plan_period_s:
            raise ValueError("default_plan_idle_s must be >= default_plan_period_s")
        if self.server_lr != "participants" and not (0 < self.server_lr < float("inf")):
            raise ValueError("server_lr must be a finite number > 0, or 'participants'")
        return self
