"""Every config key and its default (docs/config.md lists them).

A config file starts from `get_config()` and sets what it changes (configs/palm_tiny.py takes
the defaults as they are; the others start from palm_tiny with `pwtrain.config.base_config`),
so no code needs a fallback for a key a config left out.
"""

import ml_collections


def get_config():
  """Every key with its default: the tiny model of configs/palm_tiny.py, trained on CPU."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 512
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 8
  c.model.num_kv_heads = 1  # 1 = multi-query attention (PaLM); >1 = grouped-query.
  c.model.head_dim = 16
  c.model.d_ff = 512
  c.model.rope_base = 10000.0
  c.model.z_loss = 1e-4
  c.model.dtype = "float32"  # activation/compute dtype
  c.model.param_dtype = "float32"
  # Rematerialisation per block (models/remat.py): "none", "full", "dots" (keep matmul
  # outputs) or "outputs" (keep only attention and FFN outputs).
  c.model.remat = "none"
  # Scanned layers (models/scan.py): the blocks' parameters stacked on a leading "layers" axis
  # and run with jax.lax.scan, so compile time does not grow with depth. Same parameters, same
  # numbers, and checkpoints restore either way. With MoE, num_layers must be a multiple of
  # moe.every (a period of every - 1 dense blocks and one MoE block is scanned).
  c.model.scan_layers = False
  # Attention implementation: "einsum" (written out, float32 softmax), "invariant" (written out
  # with reductions instead of dots: the KV-cache decode rounds as the forward, for exact RL),
  # or jax.nn.dot_product_attention's "xla" or "cudnn" (NVIDIA GPUs, bf16/fp16).
  c.model.attention = "einsum"
  # Model families (models/family.py, docs/models.md): "palm" (parallel block, LayerNorm, tied
  # output layer scaled by 1/sqrt(d_model)), "llama" (sequential block, RMSNorm, SwiGLU, untied
  # output layer) or "gemma" (sequential, RMSNorm (1 + w), GeGLU, embeddings x sqrt(d_model),
  # tied output layer). model.rope_base is rope's theta for every family.
  c.model.family = "palm"
  c.model.norm_eps = 1e-6  # every norm's epsilon
  # The MLP gate's activation: "" the family's (silu: palm, llama; gelu_tanh: gemma), "silu",
  # "gelu_tanh" (GELU's tanh approximation) or "gelu" (exact GELU, erf).
  c.model.activation = ""
  c.model.tie_embeddings = False  # llama: the output layer is the embedding (Llama 3.2 1B)
  c.model.qkv_bias = False  # llama: biases on the q, k and v projections (Qwen2)
  c.model.qk_norm = False  # llama: RMSNorm of each query and key head before rope (Qwen3)
  c.model.rope_scaling = "none"  # llama: "llama3", Llama 3.1's long-context frequencies
  c.model.rope_factor = 8.0  # rope_scaling="llama3": its factor, low/high_freq_factor and
  c.model.rope_low_freq_factor = 1.0  # original_max_position_embeddings
  c.model.rope_high_freq_factor = 4.0
  c.model.rope_original_max_len = 8192
  # llama, gemma: a local layer's query sees the last sliding_window keys (0: all layers global);
  # pattern 0: every layer local (Mistral), n: layer i global when (i + 1) % n == 0 (Gemma 2: 2).
  c.model.sliding_window = 0
  c.model.sliding_window_pattern = 0
  c.model.query_pre_attn_scalar = 0  # gemma: queries scaled by its ^-1/2 (0: head_dim's)
  c.model.attn_softcap = 0.0  # gemma: attention logits -> cap * tanh(logits / cap); 0: none
  c.model.final_softcap = 0.0  # gemma: output logits likewise
  c.model.post_norms = False  # gemma: a norm after attention and after the MLP (Gemma 2)

  # Sparse Mixture-of-Experts FFNs (pwtrain/models/moe.py). num_experts=0: dense (PaLM).
  c.moe = ml_collections.ConfigDict()
  c.moe.num_experts = 0
  c.moe.every = 2  # layer i (from 0) is MoE if (i + 1) % every == 0; 1: every layer
  c.moe.top_k = 2  # experts per token: 1 (Switch) or 2 (GShard)
  c.moe.d_ff = 0  # each expert's hidden size; 0: model.d_ff // top_k (dense's active FFN size)
  c.moe.capacity_factor = 1.25  # training: slots per expert = top_k * factor * seq_len / experts
  c.moe.eval_capacity_factor = 2.0  # the same at inference (model.__call__)
  c.moe.dropless = False  # True: no capacity, no drops (sorted tokens, grouped matmuls)
  c.moe.jitter = 0.0  # router input noise: x * U[1 - jitter, 1 + jitter] while training
  c.moe.aux_loss_weight = 1e-2  # load-balancing loss (Switch/GShard), per MoE layer
  c.moe.router_z_loss_weight = 1e-3  # router z-loss (ST-MoE)

  c.data = ml_collections.ConfigDict()
  # "pystdlib" (built-in corpus), "files" (your own: data.files) or any prepared TFDS name
  # (e.g. "lm1b").
  c.data.dataset = "pystdlib"
  c.data.files = ""  # "files": a glob, or globs separated by commas, of text or .jsonl files
  c.data.jsonl_field = "text"  # "files": the field of each JSONL line that holds the text
  # "files": skip (and count, and name) JSONL lines without that text field and files that are
  # not UTF-8, instead of refusing the first one.
  c.data.skip_bad_records = False
  c.data.data_dir = ml_collections.config_dict.placeholder(str)  # None: <workdir>/tfds
  c.data.split = "train"
  # The held-out split evaluation reads: the built-in corpus holds out ~5% of its files as
  # "validation"; for a TFDS dataset name one of its splits (e.g. "test" for lm1b).
  c.data.eval_split = "validation"
  c.data.text_key = "text"
  c.data.max_files = 400  # built-in corpus only: cap on source files read (0 = all)
  c.data.tokenizer = "byte"  # "byte", "sentencepiece" or "huggingface"
  # An existing tokenizer to load: a SentencePiece .model ("sentencepiece"; without a path one is
  # trained on the corpus) or a Hugging Face tokenizers .json ("huggingface").
  c.data.tokenizer_path = ""
  c.data.eos_token = ""  # "huggingface": the document separator ("": </s>, <|endoftext|>, ...)
  # "huggingface": documents and prompts encoded with the tokenizer's own special tokens (a BOS
  # where it adds one), as transformers encodes them; an imported model's (pwtrain.convert).
  c.data.add_special_tokens = False
  # "huggingface": tokens besides data.eos_token at which generation (sampling, serving) stops;
  # an imported model's eos_token_id list (generation_config.json's, else config.json's).
  c.data.stop_tokens = ()
  c.data.sp_vocab_size = 512
  c.data.seq_len = 128
  c.data.shuffle = True
  # Independent packed streams the global batch's rows are split into (contiguous blocks, one
  # per stream). 1 is one stream; in distributed mode set it to the pods (or a multiple) so that
  # each process reads only its pods' rows (pwtrain/data/loader.py). Part of the data stream.
  c.data.streams = 1

  c.train = ml_collections.ConfigDict()
  c.train.global_batch = 16
  c.train.num_steps = 300
  c.train.num_microbatches = 1  # gradient accumulation, or pipeline microbatches
  c.train.log_every = 10
  c.train.checkpoint_every = 100
  c.train.keep_checkpoints = 3
  c.train.resume = True
  c.train.async_checkpoint = True
  # JAX's persistent compilation cache, so that a restart, a rejoin or a second run loads its
  # programs instead of compiling them: "" is <workdir>/compile_cache (unless
  # $JAX_COMPILATION_CACHE_DIR names one), "off" turns it off.
  c.train.compile_cache_dir = ""
  # Its cap in bytes, JAX's entries and the saved pieces together, least recently used evicted
  # first (backend/saved.py); 0: no cap.
  c.train.compile_cache_max_bytes = 0
  # Loss spikes (PaLM section 5.1): a step whose loss or gradient norm is NaN/Inf is skipped
  # (parameters and optimizer state unchanged, counted in the "skipped" metric); after
  # rollback_after consecutive skipped steps the trainer reloads the last checkpoint from before
  # them and goes on with the data after the bad batches (plus rollback_skip_batches more).
  c.train.skip_nonfinite = True
  c.train.rollback_after = 3  # 0: never roll back
  c.train.rollback_skip_batches = 0
  c.train.max_rollbacks = 3  # then stop with an error; the checkpoints stay intact
  # (start, stop): a jax.profiler trace of steps start+1..stop in <workdir>/profile; (): none.
  c.train.profile_steps = ()
  c.train.eval_every = 100  # evaluate on data.eval_split every N steps and at the end (0: never)
  c.train.eval_batches = 4  # batches of train.global_batch per evaluation
  # What the step minimises (pwtrain/objectives.py): "lm" (next-token cross-entropy) or "grpo"
  # (the policy gradient of sampled completions, docs/rl.md; batches from the RL loop).
  c.train.objective = "lm"

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adafactor"  # "adafactor" (PaLM), "adamw" (cosine schedule) or "sgd"
  c.optim.lr = 1e-2
  # Learning-rate schedule: "auto" (adafactor/sgd: PaLM's rsqrt; adamw: cosine), "rsqrt",
  # "cosine", "linear", "wsd" (warmup-stable-decay) or "constant"; all warm up linearly.
  c.optim.schedule = "auto"
  c.optim.warmup_steps = 30
  c.optim.constant_steps = 10_000  # PaLM: constant lr for 10k steps, then 1/sqrt(step)
  c.optim.b1 = 0.9
  c.optim.decay_rate = 0.8  # Adafactor second moment: beta2 = 1 - step^-0.8
  c.optim.clip_norm = 1.0
  c.optim.weight_decay = 1.0  # Adafactor: decay = weight_decay * lr^2 (PaLM uses lr^2)
  c.optim.b2 = 0.95  # AdamW only
  c.optim.end_lr_fraction = 0.1  # where cosine, linear and wsd end, as a fraction of lr
  c.optim.decay_fraction = 0.2  # wsd: the last fraction of train.num_steps that decays

  c.parallel = ml_collections.ConfigDict()
  c.parallel.islands = 1  # number of islands the local devices are carved into
  c.parallel.devices_per_island = 0  # 0: all local devices / islands
  c.parallel.data = -1  # -1: whatever is left of the island after fsdp and tensor
  c.parallel.fsdp = 1
  c.parallel.tensor = 1
  c.parallel.expert = 1  # expert parallelism: experts split over it (tokens too, like data)
  c.parallel.stages = 1  # pipeline stages, one island each (parallel.islands must match)
  # "gpipe", "1f1b", "zero_bubble" or "interleaved"; see train.num_microbatches
  c.parallel.schedule = "1f1b"
  c.parallel.virtual_stages = 1  # interleaved: model chunks per island (S·v chunks in all)
  # What a stage (or an overlapped exchange's chunk) keeps for its backward per microbatch in
  # flight: "full" keeps only its input and recomputes its forward in the backward (GPipe's
  # re-materialisation: least memory, a third more compute); "none" keeps what autodiff keeps
  # under model.remat (no extra compute; unrolled at remat "none", every intermediate).
  c.parallel.stage_remat = "full"
  # Layer index where each stage starts, plus num_layers at the end, e.g. (0, 1, 3, 4);
  # None: the planner balances stages by FLOPs (embedding/head counted to their stages).
  c.parallel.stage_boundaries = ml_collections.config_dict.placeholder(tuple)

  c.parallel.pods = 1  # data-parallel replicas on separate islands (islands = pods * stages)

  c.exchange = ml_collections.ConfigDict()  # how pods share gradients (parallel.pods > 1)
  c.exchange.mode = "sync"  # "sync" (PaLM), "overlapped", "stale" or "diloco" (exchange.py)
  c.exchange.compression = "none"  # "none", "bf16" or "int8" (one scale per row)
  c.exchange.error_feedback = False  # carry what compression lost into the next step
  c.exchange.buckets = 4  # overlapped, one stage: chunks of layers whose grads go separately
  c.exchange.inner_steps = 10  # diloco: local steps between outer steps (H)
  c.exchange.outer_lr = 0.7  # diloco: outer SGD learning rate (DiLoCo's value)
  c.exchange.outer_momentum = 0.9  # diloco: outer Nesterov momentum

  c.backend = ml_collections.ConfigDict()
  c.backend.mode = "embedded"
  c.backend.max_inflight_steps = 1  # unfinished steps allowed when enqueueing the next (0: sync)
  # Where execution is not serialized (GPUs, TPUs): computations each island may have launched
  # and not finished; the rest wait in its queue, where serving can go ahead (0: no bound).
  c.backend.launch_window = 2
  c.backend.trace = False  # write <workdir>/trace.json (Chrome/Perfetto)
  # Remote islands (backend.mode="remote"): one island worker per island
  # (`python -m pwtrain.backend.remote.worker`).
  c.backend.workers = ()  # their addresses, e.g. ("127.0.0.1:7001", "127.0.0.1:7002")
  c.backend.launch_workers = False  # True: start them on loopback here (and restart on faults)
  c.backend.token_file = ""  # the shared token's file; "" reads $<backend.token_env>
  c.backend.token_env = "PWTRAIN_WORKER_TOKEN"
  # Workers off loopback serve TLS (worker --tls_cert/--tls_key): the PEM file that verifies
  # them, their CA or their self-signed certificate. "" connects without TLS.
  c.backend.tls_ca = ""
  c.backend.rpc_timeout_s = 30.0  # deadline of every call that should answer at once
  # Distributed mode (backend.mode="distributed"): processes on JAX's runtime, started by
  # `python -m pwtrain.launch` or a cluster scheduler (backend/distributed.py). Unset values come
  # from $PWTRAIN_COORDINATOR/$PWTRAIN_NUM_PROCESSES/$PWTRAIN_PROCESS_ID, else JAX's cluster
  # auto-detection (SLURM, Open MPI, Cloud TPU).
  c.backend.coordinator = ""  # "host:port" that process 0 serves
  c.backend.num_processes = 0
  c.backend.process_id = -1
  c.backend.connect_timeout_s = 60  # how long a process waits for all others to join
  # How long a transfer pulled from another process may take to arrive before that process is
  # taken for dead or silent (this one then stops, naming it, and the launcher restarts the run);
  # longer than any compile or checkpoint of the peer.
  c.backend.pull_timeout_s = 600.0

  c.fault = ml_collections.ConfigDict()  # lost workers (remote) or processes (pwtrain.launch)
  c.fault.max_restarts = 0  # restart workers and resume from the last checkpoint this often
  c.fault.heartbeat_s = 2.0  # health-check period; a worker missing 3 pings in a row is lost
  # Remote: a worker whose execution queue runs one op longer than this is wedged, and lost;
  # distributed: a process one of whose computations runs longer than this is wedged, and ends
  # (longer than any one computation or checkpoint copy of an island); 0: never.
  c.fault.progress_timeout_s = 600.0
  c.fault.elastic = False  # True: a lost pod is dropped, the run goes on, it rejoins when back
  c.fault.keep_global_batch = True  # elastic: survivors take the lost pod's rows (else shrink)
  c.fault.min_pods = 1  # elastic: below this many live pods the loss stops the run
  c.fault.host_lost_pods = True  # elastic: survivors run lost pods' microbatches (else rebuild)
  c.fault.inject = ""  # elastic drills: "kill:pod1@step6,rejoin:pod1@step10"

  # Reinforcement learning from sampled completions (train.objective="grpo", docs/rl.md).
  c.rl = ml_collections.ConfigDict()
  # The objective's (pwtrain/objectives.py): the distribution completions are sampled from, the
  # same in the sampler and in the trainer's log-probabilities (top_k, top_p: 0 and 1 are off;
  # a cut changes the behaviour policy), the ratio's clip range and the KL penalty to the
  # initial parameters (k3; > 0 keeps a frozen copy of them in the train state).
  c.rl.temperature = 1.0
  c.rl.top_k = 0
  c.rl.top_p = 1.0
  c.rl.clip_low = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
  c.rl.clip_high = 0.2
  c.rl.kl_coef = 0.0
  # The loop's (pwtrain/rl/): where prompts come from, how they are scored and sampled.
  c.rl.task = ""  # a built-in task ("shift": the toy of configs/grpo_toy.py); "": rl.prompts
  c.rl.prompts = ""  # a JSONL file of prompts (rl.task="")
  c.rl.prompt_field = "prompt"  # the field of each JSONL line that holds the prompt text
  # "module:function" or a built-in ("exact_match", "last_number", "shift"); "": the task's
  c.rl.reward = ""
  c.rl.group_size = 8  # completions per prompt; train.global_batch / group_size prompts a step
  c.rl.max_tokens = 16  # new tokens per completion at most
  c.rl.stop_at_eos = True  # a completion ends at EOS (False: always rl.max_tokens tokens)
  c.rl.normalize_std = True  # advantages divided by the group's std (False: Dr. GRPO)
  c.rl.max_staleness = 0  # 0: step N's rollouts come from the weights after step N-1
  c.rl.init_from = ""  # a run's workdir whose latest checkpoint's params the run starts from

  # Serving over HTTP (pwtrain/serve/, docs/serving.md): `python -m pwtrain.serve` reads these,
  # and serve.enabled=True serves the training run's own parameters while it trains.
  c.serve = ml_collections.ConfigDict()
  c.serve.enabled = False  # a training run serves its live parameters (embedded or remote mode)
  c.serve.host = "127.0.0.1"  # the address to listen on (loopback unless set otherwise)
  c.serve.port = 8000  # 0: any free port (logged)
  c.serve.max_batch = 8  # KV-cache slots: sequences decoded together
  c.serve.max_len = 0  # positions per slot, prompt and new tokens together; 0: data.seq_len
  c.serve.prefill_chunk = 64  # prompt tokens per prefill program at most (padded: serving.md)
  c.serve.queue_size = 64  # sequences waiting for a slot; a request beyond them gets HTTP 429
  # Under saturating load, the share of each island's time that serving may take ahead of
  # queued training work (backend/policy.py): a flood slows training by about this fraction.
  c.serve.share = 0.2
  c.serve.reload = True  # pwtrain.serve: serve a newer checkpoint as soon as one appears
  c.serve.reload_poll_s = 1.0  # how often pwtrain.serve looks for one
  c.serve.token_file = ""  # a file holding the token clients must send as a Bearer; "": none

  c.metrics = ml_collections.ConfigDict()  # besides metrics.jsonl and TensorBoard (always on)
  # Weights & Biases project ("": off). Needs `pip install 'pwtrain[wandb]'`; WANDB_MODE etc.
  # as wandb reads them (e.g. WANDB_MODE=offline).
  c.metrics.wandb_project = ""
  c.metrics.wandb_entity = ""  # "": your default entity

  c.lock()
  return c
