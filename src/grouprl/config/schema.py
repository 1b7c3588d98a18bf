"""TrainConfig's fields: the schema of a run's configuration, one attribute docstring per field.

One flat dataclass, like TRL's ``GRPOConfig``: where TRL has a name for a concept we use it
(``num_generations``, ``max_completion_length``, ``beta``, ``epsilon``, ...). Each field carries
its documentation as an attribute docstring; ``grouprl train --help`` prints them (cli_args.py,
which also parses ``--field value`` overrides).

Algorithm fields default to ``None`` and are filled from the preset named by ``algorithm``
(``grouprl.core.PRESETS``; validate.py). ``TrainConfig`` (the package's ``__init__``) adds the
methods: validation (validate.py) and YAML I/O (io.py). This module holds the fields only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainFields:
    """Every field of a run's configuration, with its type, default and documentation; TrainConfig
    (grouprl.config) is this dataclass with its methods."""

    # ---------------------------------------------------------------- model
    model: str = ""
    """Causal LM to train: a local folder with a `save_pretrained` model (or a hub name when online),
    or a llama.cpp `.gguf` file (see gguf_file). `builtin:default_policy` is the small policy
    shipped with grouprl."""
    gguf_file: str | None = None
    """A GGUF file (llama.cpp's format) in the `model` folder, named as in transformers'
    `from_pretrained(model, gguf_file=...)`; `model` may also be the path of the .gguf file itself.
    Its weights are dequantized for training (fp32 master weights, as for any model; `bf16` still
    means autocast), its tokenizer and chat template are read from it unless `tokenizer` is set,
    and checkpoints are plain safetensors folders. Needs `pip install 'grouprl[gguf]'`."""
    tokenizer: str | None = None
    """Tokenizer folder or name; defaults to `model` (for a GGUF model: the tokenizer in the file)."""
    bf16: bool | str = "auto"
    """Run matmuls in bfloat16 (autocast; master weights, gradients and optimizer state stay fp32).
    `auto`: where the hardware multiplies bf16 natively (a bf16-capable CUDA GPU, a CPU with
    AVX512-BF16 or AMX), fp32 elsewhere; `true` on other hardware is refused, since emulated bf16
    runs many times slower than fp32 (grouprl/precision.py); `false`: fp32."""
    gradient_checkpointing: bool | str = "auto"
    """Recompute each layer's activations in the backward pass instead of keeping them: measured on
    SmolLM2 (4 x 1,024 tokens), 6-9 % more update time for 42 % less peak memory. `auto`, chosen per device
    (grouprl/memory.py): on CUDA every pass (the update is a small share of a GPU step, and memory
    limits the model size); on CPU only a pass over `max_tokens_per_micro_batch` (a single sequence
    longer than the budget), so memory follows the budget whatever the completion length; `true`:
    every pass; `false`: never."""
    disable_dropout: bool = True
    """Set the policy's dropout to 0 (its saved config is unchanged). With dropout on, the
    policy's log-probs are random: the ratio at the first step is not 1, the KL to the
    reference not 0, and the clipping acts on noise."""
    lora_r: int = 0
    """LoRA rank; 0 trains every weight. With LoRA the reference policy is the base model with
    the adapter disabled, so no second copy is kept."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: str | list[str] = "all-linear"
    """Modules that get LoRA adapters: `all-linear` (any case, or all_linear) or a list of module names
    (one name, or names with commas, `q_proj,v_proj`, is a list too), each naming at least one linear
    layer (a name that matches none is refused, with the model's names); not lm_head or the embedding
    of a model that ties them: refused, since no merged model could hold the result."""

    # ----------------------------------------------------------------- data
    train_data: str = ""
    """Training prompts: a .jsonl/.json, .csv or .parquet file, `builtin:NAME`, or a `datasets` dataset,
    `hf:NAME[:CONFIG][@SPLIT]` (the hub's, or a local folder of data files: hf:openai/gsm8k:main; without
    @SPLIT, its train split, and for eval_data its test or validation split). Needs a `prompt` column
    (a string, or a list of chat messages; another name: prompt_column); other columns reach reward
    functions."""
    eval_data: str | None = None
    """Held-out prompts in the same form; with neither eval_data nor eval_fraction, no evaluation runs."""
    eval_fraction: float = 0.0
    """Hold out this fraction of train_data (seeded) as the eval set when eval_data is not given."""
    max_eval_samples: int | None = None
    """Evaluate on at most this many eval prompts (at least 1); null: all of them."""
    prompt_column: str = "prompt"
    """Name of the column holding the prompt."""
    chat_prompts: bool = False
    """String prompts become one user message each, so they go through the chat template (a string
    otherwise goes to the model as it is: right for a base model, wrong for an instruct one)."""
    system_prompt: str | None = None
    """A system message put first in every prompt, train and eval (string prompts then become chat
    messages, as with chat_prompts); a prompt that starts with a system message of its own keeps it."""

    # -------------------------------------------------------------- rewards
    reward_funcs: list[Any] = field(default_factory=list)
    """Reward functions: built-in names, `module:function` import paths, or mappings
    `{name: NAME, param: value}` for parametrised built-ins. Signature
    `f(prompts, completions, **columns) -> list[float | None]` (TRL's)."""
    reward_weights: list[float] | None = None
    """Weight of each reward function in the summed reward; default all 1."""
    reward_timeout_s: float | None = 60.0
    """A reward function call that takes longer fails (or gets reward_fallback); null: no timeout."""
    reward_fallback: float | None = None
    """When set, a reward that raises, hangs or returns NaN gets this value (counted in the metrics)
    instead of stopping the run."""
    reward_workers: int = 0
    """Worker processes that run the reward and audit functions (per rank), each call cut into slices (whole
    groups, or rows for a function marked `rowwise`), while those kept in the trainer (reward models) run
    too: for rewards that are Python work (math-verify reads LaTeX with a parser and sympy, ~5 ms a row);
    0: all in the trainer's process (docs/rewards.md, "Reward workers")."""
    step_delimiter: str = "\n"
    """Process supervision: a reward function that returns (k, reward) step pairs with an int k
    means the k-th piece of the completion split after each occurrence of this string
    (docs/rewards.md, "Step rewards")."""
    accuracy_reward: str | None = None
    """Name of the reward function whose mean on greedy eval completions is reported as `accuracy`;
    default: the first reward function."""

    # ------------------------------------------------------------ algorithm
    algorithm: str = "grpo"
    """Preset: grpo | dr_grpo | dapo | gspo | gmpo | rloo | cispo | sapo | bnpo | gdpo | top_entropy |
    opsm | reinforce_pp | reinforce_pp_baseline | grpo_passk | on_policy_distill | ppo (README's
    algorithm table; on_policy_distill needs teacher_model). Every field below overrides it."""
    advantage_estimator: str | None = None
    """`grpo` (group-relative, see scale_rewards), `rloo` (leave-one-out), `reinforce_pp` (whitened
    over the batch), `reinforce_pp_baseline` (group mean removed, then the batch std), `grpo_passk`
    (only each group's best completion: r_max - r_second_max), or `process` (process supervision,
    DeepSeekMath 4.1.3: reward functions may return step rewards; each token's advantage is the sum
    of the normalised rewards of the steps ending at or after it, the outcome reward counting as a
    final step), or `gae` (PPO: generalised advantage estimation over the tokens from the value
    head's estimates, needs value_head; see gamma, lam). Preset by algorithm."""
    scale_rewards: str | None = None
    """Divide centred rewards by the std of the `group`, of the whole `batch`, or `none` (Dr. GRPO).
    The reinforce_pp estimators normalise over the batch: `batch` or `none`."""
    multi_objective_aggregation: str | None = None
    """With several reward functions: `sum_then_normalize` (the weighted sum is the reward, then the
    estimator) or `normalize_then_sum` (GDPO: each function normalised within its group, the
    weighted sum whitened over the batch; needs advantage_estimator grpo). dynamic_sampling and the
    zero_std_frac metric still judge a group by its summed reward."""
    loss_type: str | None = None
    """Per-token policy term: `clip` (PPO/GRPO clipped surrogate), `cispo` (clipped, stop-gradient IS
    weight times log-prob: every token keeps a gradient; epsilon/epsilon_high bound the weight to
    [1-epsilon, 1+epsilon_high], epsilon=1 for no lower bound), `sapo` (smooth sigmoid gate,
    sapo_temperature_pos/neg) or `gmpo` (GMPO: the geometric mean of the token ratios, each clipped
    in log space to [-epsilon, epsilon_high] on the side its advantage pushes, one ratio per
    completion; epsilon/epsilon_high are log-space bounds there, the paper's 0.4)."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for tokens with positive advantage (paper: 1.0)."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for the others (paper: 1.05; higher decays their gradient faster)."""
    top_entropy_quantile: float | None = None
    """Only this top fraction of each micro-batch's tokens by entropy carries the policy gradient
    (Beyond the 80/20 rule: 0.2); 1 keeps all. The quantile is over a micro-batch, so the update
    depends on micro_batch_size unless it is the whole batch."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2: drop completions with negative advantage whose mean log(pi_sampler/pi_theta)
    per token exceeds this (TRL suggests 0.5); None: off. Acts only off-policy (num_iterations > 1,
    or a sampler with its own log-probs such as vLLM)."""
    value_head: bool | None = None
    """PPO's learned value function: a linear layer on the policy's last hidden state (one forward for
    log-probs and values, H+1 more parameters), trained with the policy by vf_coef times the value
    loss; advantage_estimator gae reads it, and needs it. Preset by algorithm (ppo: true)."""
    gamma: float = 1.0
    """GAE discount over completion tokens (advantage_estimator gae); 1: the outcome reward undiscounted."""
    lam: float = 0.95
    """GAE lambda (advantage_estimator gae): 1 is the Monte-Carlo return minus the value, 0 the
    one-step TD error."""
    value_learning_rate: float | None = None
    """Learning rate of the value head (value_head; its own optimizer group, on the same schedule);
    null: 10 x learning_rate (the critic/actor ratio of verl's PPO examples: the head starts at zero,
    and at the policy's rate it barely moves in a short run)."""
    vf_coef: float = 0.1
    """Weight of the value loss added to the policy loss (value_head)."""
    cliprange_value: float | None = 0.2
    """Value-loss clipping (value_head): the new value prediction is clipped to old value +- this in
    the clipped term of max((v - R)^2, (v_clip - R)^2); null: no clipping."""
    loss_agg: str | None = None
    """How token losses become one number: seq-mean-token-mean | token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm. Normalised over the whole optimizer batch."""
    epsilon: float | None = None
    """Lower clip range of the ratio (1 - epsilon); with loss_type gmpo, of the log-ratio (-epsilon)."""
    epsilon_high: float | None = None
    """Upper clip range of the ratio (1 + epsilon_high); DAPO's clip-higher uses 0.28. With loss_type
    gmpo, of the log-ratio (+epsilon_high; the paper's 0.4). Left unset beside an `epsilon` of one's
    own, it is that epsilon where the preset's range is symmetric (as TRL's), and the preset's own
    upper range where it is not (dapo, gspo, cispo, top_entropy)."""
    beta: float | None = None
    """Weight of the per-token KL penalty to the reference policy; 0 loads no reference model."""
    entropy_coef: float = 0.0
    """Entropy bonus: adds -entropy_coef * H to each token's loss, H the entropy of the policy's
    next-token distribution (at `temperature`) from the same log-prob pass, aggregated like the
    policy loss (loss_agg). 0 turns it off and computes nothing extra; 1e-3 is a usual start."""
    kl_estimator: str = "k3"
    """KL estimator for the penalty, added to the loss: k3 (its gradient is the forward KL's,
    KL(ref || policy): DeepSeekMath, TRL) | k2 (the reverse KL's, KL(policy || ref)) | k1 (its gradient is
    zero in expectation on the policy's own samples: refused with beta > 0, docs/algorithms.md §5)."""
    importance_sampling_level: str | None = None
    """`token` ratios (GRPO) or one `sequence` ratio per completion (GSPO)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 + epsilon_high: for negative advantages the token loss is capped at -c*A."""
    delta: float | None = None
    """Two-sided cap: the unclipped term uses min(ratio, delta) (INTELLECT-2)."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing (0 or more)."""
    dynamic_sampling: bool | None = None
    """DAPO: drop groups whose rewards are all equal (a group baseline gives them zero advantage) and
    sample more prompts to refill the batch. Refused with PPO's value head or a teacher (distill_coef),
    under which those groups still carry a signal."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: at most this many generation rounds per step."""
    overlong_shaping: bool | None = None
    """DAPO soft overlong punishment added to the reward."""
    overlong_cache_len: int | None = None
    """Length of DAPO's soft punishment window; default a fifth of max_completion_length (the paper's
    4,096 of 20,480: the ramp starts at its expected maximum, 16,384)."""
    ref_update_steps: int = 0
    """DeepSeekMath iterative mode: every K steps the reference becomes the current policy (0: never)."""
    teacher_model: str | None = None
    """On-policy distillation (docs/algorithms.md, 1.7): a causal LM (folder or hub name) that scores
    the policy's own completions token by token; each token's advantage gets distill_coef x
    (log pi_teacher - log pi_student) of the sampled token. Frozen: no gradient, eval mode, not in the
    optimizer or the checkpoints (a resumed run loads it again from here); held in the compute dtype
    (bf16 when `bf16` is on) on the device the reference model runs on. It must share the policy's
    tokenizer (a mismatch is an error naming both)."""
    distill_coef: float | None = None
    """lambda, the weight of the teacher's per-token signal: A = distill_reward_coef x A_reward +
    distill_coef x (log pi_teacher - log pi_student) on every completion token, A_reward the
    estimator's advantages of the verifier rewards. Preset: 1 in on_policy_distill, 0 elsewhere;
    above 0 it needs teacher_model."""
    distill_reward_coef: float | None = None
    """c_R, the weight of the verifier rewards' advantages in that sum. Preset: 0 in on_policy_distill
    (the teacher alone; rewards are still scored, logged and read by the eval), 1 elsewhere (a
    teacher set with distill_coef > 0 is mixed with the rewards)."""
    distill_signal: str = "reverse_kl"
    """The teacher's per-token signal (core DISTILL_SIGNALS): `reverse_kl`, log pi_teacher - log
    pi_student on the sampled token (tinker-cookbook, SkyRL; core/distillation.py says why)."""

    # ----------------------------------------------------------- generation
    num_generations: int = 8
    """Completions per prompt (G, the group size)."""
    prompts_per_step: int = 4
    """Prompts per step (B); a step trains on B * num_generations completions."""
    max_prompt_length: int | None = None
    """Prompts longer than this many tokens (at least 1) are cut from the left, with a warning the first
    time; None keeps them whole."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """More arguments for the chat template, wherever it renders the policy's conversations (prompts,
    eval prompts, a multi-turn rollout's tool results and next turn), as TRL's field of that name:
    e.g. {enable_thinking: false} for Qwen3's template without its thinking block."""
    max_completion_length: int = 256
    """Tokens generated per completion at most."""
    temperature: float = 1.0
    """Sampling temperature (also divides the logits when computing log-probs, as TRL does)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    ignore_eos: bool = False
    """Always generate max_completion_length tokens (benchmarks: both sides compute the same tokens)."""
    mask_truncated_completions: bool = False
    """Completions that hit max_completion_length without EOS get no loss."""
    generation_batch_size: int | None = None
    """Completions decoded together at most (whole groups: at least num_generations; an eval's groups
    of num_generations_eval are decoded whole too); default all of a step's completions at once."""
    generation_compile: bool | str = "auto"
    """The built-in engine's decode step compiled with torch.compile (rollout/compiled_decode.py):
    one fused graph per token instead of ~100 small ops, drawing the same tokens as the eager step.
    For the models of the built-in engine's fast path (Llama, Mistral, Qwen2, Qwen3, SmolLM3; vLLM
    compiles its own). `auto`: the first two rollouts decode eagerly and are timed (a multi-turn
    rollout's every turn, a rollout cut into generation_batch_size calls all of them); the run then
    compiles if the decode time its remaining steps' rollouts would save exceeds what a compile
    costs (README "Generation" gives the measured figures; the evaluation's calls would save more,
    uncounted, so auto errs towards eager); `true`: always; `false`: never. Where compiling fails
    (no C++ compiler, an op Inductor cannot lower) the run warns once, naming the reason, and
    decodes eagerly (on CUDA, the eager step replayed as graphs: `generation_cuda_graphs`)."""
    generation_cuda_graphs: bool = True
    """On CUDA: replay each decode step as a captured CUDA graph, one launch instead of one per
    kernel (hundreds for a 30-layer model), captured once per shape of a generate call. The step
    is the compiled one when `generation_compile` compiles, else the eager one (unfused kernels,
    still none launched from Python). Where a capture fails the run warns once and launches the
    kernels one by one; `false` always does, and decodes without compiling in the plain eager loop.
    On an H100 the eager step replayed decoded the 135M shape at ~2.6 ms a token against 16-21
    launched (benchmarks/README.md). Multi-turn calls replay too. No effect on CPU or with vLLM
    (which captures its own)."""

    # ---------------------------------------------- sampler/trainer mismatch
    vllm_importance_sampling_correction: bool | None = None
    """Correct for an engine that samples with other kernels than the trainer (vLLM; its rollouts
    carry the sampler's log-probs): the policy loss of each token is weighted by a function of the
    ratio pi_old(trainer) / pi_sampler (docs/vllm.md). None (default): on whenever the rollout
    carries the sampler's log-probs, so on with vLLM and off with the built-in engine, which samples
    from the trainer's own model; true: on (needs use_vllm); false: off.
    It needs the trainer's pi_old even with num_iterations = 1: one extra no-grad forward pass over
    the batch per step."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """token_truncate | token_mask | sequence_truncate | sequence_mask: the ratio per token or per
    completion (exp of the summed log-ratio), truncated at the cap (TIS, Yao et al. 2025) or masked
    outside [vllm_importance_sampling_min, cap]. Default sequence_mask, TRL's default."""
    vllm_importance_sampling_cap: float = 3.0
    """C: *_truncate modes cap the ratio at C, *_mask modes drop ratios above it. Default 3, TRL's;
    the TIS paper uses 2 with token_truncate. At least 1, so a token with no mismatch keeps weight 1."""
    vllm_importance_sampling_min: float = 0.0
    """Lower bound C_min of the *_mask modes, in [0, 1]: ratios below it are dropped too. Default 0,
    TRL's (mask above the cap only); verl's mask mode defaults to 1/cap."""

    # ------------------------------------------------------------- optimizer
    learning_rate: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only: biases and norm gains are not decayed (HF Trainer's rule)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null (or 0) disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps."""
    lr_scheduler_type: str = "constant"
    """Schedule after warm-up: constant | linear | cosine (decay to 0 at the last step)."""
    num_iterations: int = 1
    """Policy updates per rollout (PPO's mu). With 1 the ratio is exactly 1 and no old log-probs
    are computed."""
    micro_batch_size: int | str = "auto"
    """The most completions a forward/backward pass takes (with `max_tokens_per_micro_batch` set,
    the token budget may cut a pass shorter); gradients accumulate to the full-batch gradient. A
    number above the completions of a step means the whole step, and a number must divide them.
    `auto`, per device (grouprl/memory.py): 16 on CPU (the last pass takes what is left); on CUDA
    no row limit beyond one rank's share of the step, so the token budget alone sizes the passes
    (16 rows when `max_tokens_per_micro_batch` is null: then nothing else bounds a pass). A GPU
    update waits on launching each pass's kernels, and two 16-row passes launch twice the ops of
    one 32-row pass (benchmarks/README.md, "Launches per update")."""
    max_tokens_per_micro_batch: int | str | None = "auto"
    """Token budget of one forward/backward pass of the update and the log-prob passes: consecutive
    completions (group by group) go into a pass while its tokens stay within the budget (and at
    most micro_batch_size rows). Tokens as the pass computes them: packed (`padding_free`), the real
    tokens, each distinct prompt once; padded, rows x (longest prompt + longest completion). So
    memory follows the budget, not the completion length. A single sequence longer than the budget
    runs alone (logged), never dropped. The gradient does not depend on the grouping (the
    whole-batch normaliser). `auto`, per device (grouprl/memory.py): 4096 on CPU; on CUDA a quarter
    of the device memory free after the weights, gradients and AdamW state, in tokens of the
    model's estimated activations, a power of two from 4096 to 65536 (logged at start). null:
    micro_batch_size rows per pass whatever their length."""
    padding_free: bool = True
    """Run the sequences of a pass packed in one row, attention confined to each sequence and each
    prompt once before its completions (grouprl/packing.py): no padding is computed, and the
    results equal the padded pass's to rounding. Models whose attention is not transformers' SDPA
    or eager implementation run padded (logged)."""
    share_prompt_forward: bool = True
    """Padded passes (`padding_free: false`): run each prompt of a micro-batch once and let its
    completions attend to its cached keys/values: the same math on fewer tokens. Micro-batches are
    then formed group by group. Off under gradient checkpointing, which disables the cache, and under
    FSDP2, which frees the gathered weights after each forward pass. Packed passes always lay each
    prompt down once."""
    share_prompt_min_tokens: int = 64
    """A micro-batch runs its prompts once only when that saves at least this many tokens
    (completions x prompt length - distinct prompts x (prompt length - 1)): the extra pass reads
    every weight once more, which costs about as much as 2 x (matmul FLOP/s) / (memory bytes/s)
    tokens -- ~40 on the CPU measured in benchmarks/, several hundred on a GPU."""

    # -------------------------------------------------------------- schedule
    max_steps: int = 100
    """Training steps (each: one rollout, num_iterations optimizer steps)."""
    logging_steps: int = 1
    """Report to the trackers, log samples and, where no live bar is shown (`progress: false`, or output to
    a file), print a line every this many steps (metrics.jsonl gets every step)."""
    eval_steps: int = 0
    """Evaluate every this many steps (0: only before and after training)."""
    save_steps: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    save_total_limit: int | None = 2
    """Keep at most this many checkpoints (the newest), at least 1; null keeps every one."""
    num_logged_samples: int = 4
    """Completions written to samples.jsonl each logging step."""

    # ---------------------------------------------------------------- run
    output_dir: str = "runs/grouprl"
    """Where the run writes config.yaml, metrics.jsonl, TensorBoard events, samples, checkpoints,
    summary.json and curves.png."""
    seed: int = 0
    """Seeds data order, sampling and initialisation; 0 to 2**32 - 1 (numpy's range)."""
    num_threads: int | None = None
    """torch intra-op threads (at least 1); default (null): torch's choice."""
    progress: bool = True
    """Show a live progress bar on a terminal (where the output is a file, a line every logging_steps)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, any of tensorboard (output_dir/tensorboard), trackio, wandb, mlflow; [] or
    [none] for none. Each but tensorboard is an extra: pip install 'grouprl[trackio]' (README,
    "Experiment trackers"). metrics.jsonl is written whatever this says."""
    run_name: str | None = None
    """The run's name in the trackers; default: the output_dir folder's name."""
    log_completions_steps: int = 10
    """Every this many steps (on a logging step), a table of num_logged_samples completions (prompt,
    completion, each reward, advantage, length, stop reason, tool calls) goes to the trackers; 0: never."""

    # ----------------------------------------------------------- evaluation
    eval_metrics: list[str] = field(default_factory=lambda: ["greedy"])
    """What `evaluate` reports from the accuracy reward: `greedy` (one greedy completion per prompt:
    `accuracy`), `mean@k`, `pass@k` (unbiased, from num_generations_eval >= k samples), `maj@k` (the
    answer most of k samples give, read by math-verify). grouprl/evaluation.py defines each."""
    num_generations_eval: int = 1
    """Completions sampled per eval prompt for the mean@k / pass@k / maj@k metrics."""
    eval_temperature: float | None = None
    """Sampling temperature of those completions; default: `temperature`."""
    metric_for_best_model: str | None = None
    """An eval result (`accuracy`, `pass@8`, `reward_mean`, `rewards/NAME`, ...) whose best value marks
    the best checkpoint: a checkpoint is written at each eval that improves it, and save_total_limit
    never deletes it. Named in summary.json (`best_checkpoint`)."""
    greater_is_better: bool = True
    """metric_for_best_model: whether larger is better."""
    load_best_model_at_end: bool = False
    """After training (and its last checkpoint), load the best checkpoint's weights into the model."""

    # ------------------------------------------------------------ run health
    audit_funcs: list[Any] = field(default_factory=list)
    """Functions that score training completions like reward functions (same names and signature)
    but never enter the reward or the advantage: a strict, independent checker. Logged as
    `audit/NAME/mean`; the reward-hacking monitor alarms when the reward rises and they do not."""
    on_reward_hacking: str = "warn"
    """`warn`: print and log each reward-hacking alarm (README, "Run health") with example
    completions; `stop`: also end the run after that step with a checkpoint (exit status 3);
    `off`: compute nothing."""
    on_collapse: str = "warn"
    """A collapse alarm (reward crash, KL spike, entropy collapse): `warn`, `stop` (as above), `rollback`
    (restore the policy and optimizer from a snapshot taken before the collapse, scale the learning
    rate by rollback_lr_factor and go on, at most max_rollbacks times), or `off`."""
    rollback_lr_factor: float = 0.03
    """on_collapse: rollback multiplies the learning rate by this at each rollback. Measured on the
    embedded default at 100x its learning rate (benchmarks/run_health.py): 0.1 left a rate still
    10x too high, which learned and then swung (final held-out accuracy 8 points under the sound
    run's median, one seed in five 12 points); 0.03 ended level with the sound run."""
    max_rollbacks: int = 3
    """on_collapse: rollback: after this many rollbacks the next collapse stops the run."""
    health_thresholds: dict[str, float] = field(default_factory=dict)
    """Overrides of the alarms' thresholds by name (health.py documents each; e.g. {min_gain_z: 0.5})."""
    prompt_filter: bool = False
    """Skip prompts whose last prompt_filter_history groups all had equal rewards (all solved or all
    failed): their rollouts would teach nothing. Revisited at rate prompt_filter_revisit. Logged as
    prompt_filter/skipped and prompt_filter/rollouts_saved."""
    prompt_filter_history: int = 2
    """prompt_filter: how many consecutive zero-variance groups settle a prompt."""
    prompt_filter_revisit: float = 0.1
    """prompt_filter: the probability that a settled prompt is sampled anyway (it may teach again)."""

    # ----------------------------------------------------------------- vLLM
    use_vllm: bool = False
    """Sample the rollouts with vLLM instead of the built-in engine (`pip install grouprl[vllm]`;
    on CPU-only machines see docs/distributed.md). The policy's weights are copied into vLLM after
    every optimizer step."""
    vllm_mode: str = "colocate"
    """`colocate`: a vLLM engine inside each training process, sharing its device. `server`: the
    trainer's ranks are clients of a vLLM server on other devices or nodes, started with
    `grouprl vllm-serve MODEL` (docs/vllm.md); vllm_server_* say where it is."""
    vllm_server_host: str = "127.0.0.1"
    """vllm_mode=server: host of the vLLM server."""
    vllm_server_port: int = 8000
    """vllm_mode=server: port of the vLLM server."""
    vllm_server_timeout_s: float = 240.0
    """vllm_mode=server: longest wait for the server: to come up at start, to answer a request,
    to load new weights. Past it the run stops with an error naming the server. A request returns
    whole completions, so this must exceed the longest generation (8k tokens at 40 tok/s: 200 s)."""
    vllm_server_weight_dir: str | None = None
    """vllm_mode=server: directory where rank 0 writes the new weights for the server to load
    (one file at a time, deleted once loaded): it must be readable by the server under the same
    path (a shared file system across nodes). None: output_dir/vllm_weights."""
    vllm_weight_transfer: str = "auto"
    """vllm_mode=server: how new weights reach the server. `auto`: the way the server was started
    with (`grouprl vllm-serve --weight-transfer`: `nccl` on GPUs, `gloo` on CPU, both vLLM's
    weight-transfer engines, in memory); `file`: a safetensors file in vllm_server_weight_dir (any
    server takes it; a shared file system across nodes). Naming `gloo` or `nccl` checks that the
    server runs it."""
    vllm_lora_sync: str = "auto"
    """With lora_r > 0, what reaches vLLM after each step. `adapter`: only the LoRA adapter (vLLM
    runs it with its LoRA kernels; the base weights are sent once, or not at all colocated; a
    server must be started with `grouprl vllm-serve MODEL --lora-rank R`). `merged`: the merged
    weights W + BA, the whole model each step, and vLLM runs a plain model. `auto`: the adapter
    colocated on a GPU and to a server started with --lora-rank R or more; merged otherwise (on
    CPU vLLM's LoRA kernels halve generation speed, measured: docs/vllm.md)."""
    vllm_weight_transfer_address: str | None = None
    """vllm_weight_transfer gloo/nccl: the address of this machine that the server's workers connect
    to (rank 0 listens on a free port). None: this machine's address on the route to the server."""
    async_rollouts: bool = False
    """Generate the next batch while the trainer updates on this one (one-step asynchronous GRPO),
    so a sample is up to max_staleness updates older than the policy that trains on it; the
    importance-sampling correction (trainer's pi_old over the sampler's log-probs) covers that.
    Needs use_vllm with vllm_mode: server (docs/vllm.md says why)."""
    partial_rollouts: bool = False
    """async_rollouts: a weight update does not wait for the batches being generated; they go on
    under the new weights, each token's log-prob from the weights that drew it (the importance
    correction weighs each token by its own). Staleness counts from a batch's oldest token, so
    max_staleness holds as before; `rollout/partial_frac` is the share of completions an update
    overlapped. Off: an update waits, and every batch is sampled by one version."""
    max_staleness: int = 1
    """async_rollouts: the most training steps (weight syncs) a sample's weights may lag the
    trainer's when it is trained on; the number of batches generated ahead. 0 is synchronous."""
    vllm_gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory vLLM may take for its weights and KV cache; the rest stays for the
    policy and the optimizer. On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB (default 1) instead."""
    vllm_enable_sleep_mode: bool = False
    """Between rollouts vLLM moves its weights to host memory and frees its KV cache, so the update
    has the GPU to itself; waking up costs a host-to-device copy. Not available on CPU."""
    vllm_dtype: str | None = None
    """dtype vLLM computes in: float32 | bfloat16 | float16 | auto (the checkpoint's, vLLM's rule).
    None follows the trainer: bfloat16 when its bf16 is on (`auto` resolved for the device), float32
    otherwise."""
    vllm_max_model_length: int | None = None
    """Longest prompt + completion vLLM serves; None takes the model config's maximum."""
    vllm_enforce_eager: bool = False
    """Run vLLM without CUDA graphs / torch.compile: slower decoding, faster start-up."""

    # ---------------------------------------------------------- distributed
    distributed_strategy: str = "ddp"
    """Under torchrun: `ddp` keeps a whole model on every rank and averages gradients; `fsdp2`
    shards parameters, gradients and optimizer state (torch `fully_shard`) for models that do not
    fit one device. prompts_per_step must be a multiple of the number of processes."""
    ddp_timeout: float = 1800.0
    """Under torchrun: seconds a rank waits in a collective before the run fails (transformers' name):
    the other ranks wait this long while rank 0 writes a checkpoint alone, or one rank's generation
    runs long. Raise it for large models on slow storage."""

    # ---------------------------------------------- tools and multi-turn
    tools: list[Any] = field(default_factory=list)
    """Tools the policy may call during a rollout (docs/tools.md): `python` (our sandbox), any
    typed, documented function as `package.module:function`, or a mapping `{name: python,
    timeout_s: 5}` for a tool built with parameters. Their schemas reach the model through the
    chat template; each rollout then runs turn by turn (rollout/multiturn.py)."""
    tool_parser: str | None = None
    """How the model writes tool calls: hermes (Qwen2.5/3, Hermes) | llama3 | template (the
    tokenizer's response_template). None: picked from the tokenizer and its chat template."""
    max_tool_calls: int = 8
    """Tool calls per trajectory at most; a turn whose calls would pass it ends the trajectory
    (stop reason max_tool_calls, truncated)."""
    max_turns: int = 8
    """Assistant turns per trajectory at most (stop reason max_turns, truncated). The whole
    trajectory, tool results included, also fits in max_completion_length tokens."""
    tool_timeout_s: float = 30.0
    """A tool call that runs longer is abandoned and the model is told so."""
    max_tool_output_chars: int | None = 8000
    """A tool result longer than this is shown to the model cut to its head and tail around a line
    saying how much was cut: the trajectory's token budget pays for every character. null: whole."""
    environment: str | None = None
    """A multi-turn environment class, `package.module:Class` (docs/tools.md): one instance per
    trajectory, `reset(**row)` gives the first observation, `step(assistant_message)` returns
    (observation, done[, reward]). `openenv:package.module:Class` names an OpenEnv environment
    (class or factory; `pip install 'grouprl[openenv]'`), run through `grouprl.envs.openenv`. Not
    together with tools."""
    env_timeout_s: float | None = 300.0
    """An environment's reset or step that runs longer stops the run with an error naming the
    environment and the call, as one that raises does (its thread is abandoned: Python cannot stop
    it); null: no limit."""
