"""The engine's GRPO step next to TRL's GRPOTrainer: seconds per step and peak memory, side by side.

Both sides train one random Llama checkpoint (dim 256, 4 layers, 8 heads / 4 kv heads, ffn 704,
vocab 16, tied embeddings), written here in Hugging Face format with a tokenizer.json, on the same
16 prompts of exactly P tokens, G = 8 samples each, exactly C = 32 new tokens per completion: the
config has no eos_token_id (the engine never stops a row) and TRL gets min_new_tokens = 32 (its eos
is never sampled); both sides' logged completion lengths are checked. The reward (`ones_fraction`,
the share of "1"s) is the same function on both sides and costs nothing. GRPO as close as TRL
allows: beta 0, loss "dapo", eps 0.2 / 0.28, group std scaling, mu 1, temperature 1, fp32, lr 1e-6
(the weights barely move). One optimizer step per generation batch of 16 x 8 completions,
micro-batched alike: the engine's --micro_batch_groups m is TRL's per_device_train_batch_size 8m
with gradient_accumulation_steps 16/m; by default both m = 1 (one group, TRL's default) and m = 16
(the whole generation batch in one forward/backward) run, and the tables show both.

Each side runs as anyone would run it (`python train.py --model DIR ...`; GRPOTrainer.train() in
this file re-run with --worker trl), in a fresh process, one after the other (engine, TRL, engine,
...) so that the shared machine's drift hits both, 1 thread each. Measured:
- s/step: the time between the ends of consecutive steps, taken here as each child prints its step
  line (train.py's "step k/N", a TrainerCallback's line in TRL), so both count everything in their
  loop; median over steps 2..N (step 1 warms up). Wall clock, and the process's CPU time (/proc),
  which hardly moves when other jobs share the cores.
- peak RSS: ru_maxrss of the child (os.wait4), and of a probe process that only does that side's
  imports (`import train` / trl's trainer): the import baseline. "over baseline" is what the run
  itself adds.
- the training-token ratio TRL / engine, printed beside the measured speed ratio: TRL forwards
  Bp*G*(P+C) tokens, the engine Bp*P + Bp*G*C (each prompt once per group).

--model DIR benches a Hugging Face checkpoint instead (e.g. SmolLM2-135M-Instruct; link_checkpoint:
its weights and tokenizer, without its eos, so every row still runs C tokens; digits must be one
token each), --num_prompts N (16) a smaller generation batch for a larger model.

Needs trl (and transformers, datasets); without them it prints one line and exits 0.
Run: python tests/bench_trl.py [--P 64,512] [--steps 4] [--checkpoint true,false]
         [--micro_groups 1,16] [--keep] [--quick] [--model DIR] [--num_prompts 16]
         [--defaults | --only_defaults]
         (--quick: P 64, 3 steps, checkpointing on; --defaults: one more pair, each side at its
         defaults: the engine without checkpointing, TRL with it)
Each (P, checkpoint, micro_groups) pair takes about 2 minutes at P = 64 and 7 at P = 512 (TRL
~60 CPU s/step there) on the shared 2-core CPU.
"""

import argparse
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, ROOT)

from engine import hf  # noqa: E402
from engine.tokenizer import build_char_tokenizer  # noqa: E402
from model import Llama, ModelConfig  # noqa: E402
from tasks import Task  # noqa: E402

PROMPTS = 16                 # Bp prompts per generation batch (--num_prompts sets it)
G = 8                        # samples per prompt
C = 32                       # new tokens per completion, always all of them
LR = 1e-6                    # tiny: both sides keep generating from the same model
SPECIALS = ("<pad>", "<bos>", "<eos>")
ALPHABET = "0123456789+*="   # 3 specials + 13 characters = vocab 16
ENGINE_LINE = re.compile(r"^step (\d+)/\d+ \|")
TRL_LINE = re.compile(r"^bench-trl step (\d+) end")

# -----------------------------------------------------------------------------
# The task both sides see: 16 fixed prompts and one reward function


def ones_fraction(completion: str, reference: str) -> float:
    """The share of "1"s in the completion: cheap, and it differs between samples (GRPO's
    advantages are not all zero, so both sides really train)."""
    return completion.count("1") / max(1, len(completion))


def bench_task(data: str) -> Task:
    """The engine's task (`--task bench_trl:bench_task --task_data PROMPTS.json`). sample() ignores
    its rng and cycles through the prompt file: the engine draws 16 prompts per step, so every step
    sees all 16, as TRL's sampler does (one epoch of the 16 prompts per step)."""
    with open(data) as f:
        prompts = itertools.cycle(json.load(f))

    def sample(rng: random.Random) -> tuple[str, str]:
        return next(prompts), ""  # no reference: the reward looks at the completion alone
    return Task("bench_trl", sample, [(ones_fraction, 1.0)], max_new_tokens=C)


def trl_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """TRL's reward signature around the same function."""
    return [ones_fraction(text, "") for text in completions]

# -----------------------------------------------------------------------------
# The shared checkpoint and prompt set


def write_checkpoint(path: str) -> None:
    """Random tiny Llama, HF format, with a character tokenizer. No bos (TRL's tokenizer would not
    add one: both sides see exactly P prompt tokens) and no eos (the engine never stops a row)."""
    from tokenizers import processors
    tokenizer = build_char_tokenizer(ALPHABET, SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")  # no <bos>
    assert tokenizer.get_vocab_size() == 16, tokenizer.get_vocab_size()
    cfg = ModelConfig(vocab_size=16, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None)
    hf.save_model(Llama(cfg).init_weights(0), path)
    tokenizer.save(os.path.join(path, "tokenizer.json"))


def link_checkpoint(source: str, path: str) -> None:
    """A Hugging Face checkpoint as both sides run it here: its safetensors and tokenizer.json
    linked, its config.json without eos_token_id and no generation_config.json (no early stop)."""
    os.makedirs(path)
    for name in os.listdir(source):
        if ".safetensors" in name or name == "tokenizer.json":
            os.symlink(os.path.abspath(os.path.join(source, name)), os.path.join(path, name))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.pop("eos_token_id", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_prompts(path: str, P: int) -> None:
    """16 distinct digit strings of P characters: P tokens each under the character tokenizer."""
    rng = random.Random(P)
    prompts = ["".join(rng.choice("0123456789") for _ in range(P)) for _ in range(PROMPTS)]
    assert len(set(prompts)) == PROMPTS
    with open(path, "w") as f:
        json.dump(prompts, f)


def train_tokens(P: int) -> tuple[int, int]:
    """Tokens one training forward covers: (engine, TRL)."""
    return PROMPTS * P + PROMPTS * G * C, PROMPTS * G * (P + C)

# -----------------------------------------------------------------------------
# Child processes: step-end timestamps and peak RSS, measured the same way for both sides


@dataclass
class ChildRun:
    step_ends: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (wall, cpu)
    peak_kib: int = 0                                          # ru_maxrss of the child
    returncode: int = 0
    log: str = ""

    def per_step(self, which: int) -> list[float]:
        """Seconds of steps 2..N, wall (which=0) or CPU (which=1): the gaps between step ends."""
        ends = self.step_ends
        return [ends[k][which] - ends[k - 1][which] for k in sorted(ends) if k - 1 in ends]

    def wall(self) -> float:
        return statistics.median(self.per_step(0))

    def cpu(self) -> float:
        return statistics.median(self.per_step(1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process, all its threads (Linux /proc; NaN
    elsewhere). Unlike wall time, it hardly moves when other processes share the cores."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    return env


def run_child(cmd: list[str], line: re.Pattern, log: str) -> ChildRun:
    """Run cmd; timestamp each step line as it arrives; its peak RSS from wait4 (this child and
    nothing else, unlike RUSAGE_CHILDREN, which is the maximum over all children so far)."""
    run = ChildRun(log=log)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                env=child_env(), cwd=ROOT)
        for text in proc.stdout:
            now = time.perf_counter()
            log_file.write(text)
            match = line.match(text)
            if match:
                run.step_ends[int(match.group(1))] = (now, cpu_seconds(proc.pid))
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
    run.returncode = os.waitstatus_to_exitcode(status)
    proc.returncode = run.returncode  # reaped here: Popen must not wait for it again
    run.peak_kib = usage.ru_maxrss  # KiB on Linux
    return run


def check_child(run: ChildRun, what: str, steps: int) -> None:
    if run.returncode != 0 or len(run.step_ends) != steps:
        with open(run.log) as f:
            tail = "".join(f.readlines()[-15:])
        sys.exit(f"bench_trl: {what} exited with {run.returncode} after {len(run.step_ends)} of "
                 f"{steps} steps; the end of its log {run.log}:\n{tail}")


def import_baseline_kib(side: str, log: str) -> int:
    """Peak RSS of a process that only imports what that side's process imports."""
    if side == "engine":
        cmd = [sys.executable, "-c", "import train, bench_trl"]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trl-imports"]
    run = run_child(cmd, ENGINE_LINE, log)  # no step lines: it only imports
    check_child(run, f"the {side} import probe", 0)
    return run.peak_kib

# -----------------------------------------------------------------------------
# The engine side: train.py as anyone would run it


def engine_command(model_dir: str, prompts: str, P: int, steps: int, checkpoint: bool | None,
                   micro_groups: int | None, out: str) -> list[str]:
    """None: the flag is left out (train.py's default)."""
    flags = dict(model=model_dir, task="bench_trl:bench_task", task_data=prompts,
                 prompts_per_step=PROMPTS, num_samples=G, max_new_tokens=C, max_prompt_len=P,
                 steps=steps, lr=LR, threads=1, out=out, overwrite="true", save_every=0,
                 eval_every=0)  # TRL runs no eval here; the engine's would land in a step's time
    if checkpoint is not None:
        flags["activation_checkpoint"] = str(checkpoint).lower()
    if micro_groups is not None:
        flags["micro_batch_groups"] = micro_groups
    cmd = [sys.executable, os.path.join(ROOT, "train.py")]
    for name, value in flags.items():
        cmd += [f"--{name}", str(value)]
    return cmd


def engine_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]

# -----------------------------------------------------------------------------
# The TRL side: GRPOTrainer in its own process (this file with --worker trl)


def trl_imports() -> None:
    """What the TRL worker imports before it builds anything (the import probe runs this)."""
    import datasets  # noqa: F401
    import torch  # noqa: F401
    from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401


def trl_config(args: argparse.Namespace):
    """GRPOTrainer set up as the engine runs: fp32 on the CPU, one optimizer step per generation
    batch of 16 x 8, beta 0, DAPO token-mean loss with clip-higher 0.28, exactly C new tokens."""
    import torch
    from trl import GRPOConfig
    per_device = args.micro_groups * G
    return GRPOConfig(
        output_dir=args.out, use_cpu=True, bf16=False, fp16=False, report_to="none",
        model_init_kwargs={"dtype": torch.float32}, max_steps=args.steps, learning_rate=LR,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=PROMPTS * G // per_device,  # steps_per_generation follows it
        num_generations=G, max_completion_length=C, generation_kwargs={"min_new_tokens": C},
        temperature=1.0, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        scale_rewards="group", num_iterations=1, gradient_checkpointing=args.checkpoint,
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)


def trl_worker(args: argparse.Namespace) -> None:
    import datasets
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOTrainer
    torch.set_num_threads(1)
    with open(args.prompts) as f:
        prompts = json.load(f)
    # Pad and eos from the vocabulary: ids 0 and 2 are <pad> and <eos> here, <|endoftext|> and
    # <|im_end|> in SmolLM2 (a token outside the vocabulary would be appended past the embedding).
    file = os.path.join(args.model, "tokenizer.json")
    vocab = Tokenizer.from_file(file)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=file, pad_token=vocab.id_to_token(0),
                                        eos_token=vocab.id_to_token(2))
    lengths = {len(ids) for ids in tokenizer(prompts)["input_ids"]}
    if lengths != {len(prompts[0])}:
        sys.exit(f"bench_trl: TRL's tokenizer gives prompt lengths {sorted(lengths)}, expected "
                 f"{len(prompts[0])}: both sides must see the same tokens")

    class StepClock(TrainerCallback):
        """One stdout line per optimizer step end (the parent timestamps it), and the logged
        completion lengths, which must all be C."""
        def on_step_end(self, train_args, state, control, **kwargs):
            print(f"bench-trl step {state.global_step} end", flush=True)

        def on_log(self, train_args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                print(f"bench-trl lengths {logs['completions/min_length']} "
                      f"{logs['completions/max_length']}", flush=True)

    trainer = GRPOTrainer(model=args.model, reward_funcs=trl_reward,
                          args=trl_config(args),
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()


def trl_command(model_dir: str, prompts: str, steps: int, checkpoint: bool, micro_groups: int,
                out: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", "trl", "--model", model_dir,
            "--prompts", prompts, "--steps", str(steps), "--checkpoint", str(checkpoint).lower(),
            "--micro_groups", str(micro_groups), "--out", out, "--num_prompts", str(PROMPTS)]


def trl_lengths(log: str) -> set[float]:
    """The min and max completion lengths TRL logged, over all steps."""
    with open(log) as f:
        found = [line.split()[2:4] for line in f if line.startswith("bench-trl lengths")]
    return {float(x) for pair in found for x in pair}

# -----------------------------------------------------------------------------
# One configuration, both sides, and the tables


@dataclass
class Pair:
    P: int
    checkpoint: bool | None  # None: each side's default (--defaults)
    micro_groups: int | None
    engine: ChildRun
    trl: ChildRun
    engine_split: tuple[float, float]  # median t_rollout, t_train of steps 2..N (engine's own log)


def measure_pair(work: str, model_dir: str, P: int, checkpoint: bool | None,
                 micro_groups: int | None, args: argparse.Namespace) -> Pair:
    """The engine, then TRL, each in a fresh process, on the same checkpoint and prompts.
    checkpoint = micro_groups = None: each side at its defaults (the engine's flags left out; TRL's
    gradient_checkpointing on and per_device_train_batch_size 8, one group)."""
    prompts = os.path.join(work, f"prompts_{P}.json")
    if not os.path.exists(prompts):
        write_prompts(prompts, P)
    tag = f"P{P}_{'ckpt' if checkpoint else 'nockpt'}_m{micro_groups}"
    what = f"P={P} checkpoint={str(checkpoint).lower()} micro_groups={micro_groups}"
    if checkpoint is None:
        tag, what = f"P{P}_defaults", f"P={P} each side's defaults"
    out = os.path.join(work, f"engine_{tag}")
    cmd = engine_command(model_dir, prompts, P, args.steps, checkpoint, micro_groups, out)
    engine = run_child(cmd, ENGINE_LINE, os.path.join(work, f"engine_{tag}.log"))
    check_child(engine, f"the engine ({what})", args.steps)
    records = engine_metrics(out)
    lengths = {r["completion_len"] for r in records}
    if lengths != {float(C)}:
        sys.exit(f"bench_trl: the engine's mean completion lengths were {sorted(lengths)}, not {C}")
    split = (statistics.median(r["t_rollout"] for r in records[1:]),
             statistics.median(r["t_train"] for r in records[1:]))
    print(f"  engine {what}: {progress(engine)}", flush=True)
    cmd = trl_command(model_dir, prompts, args.steps, True if checkpoint is None else checkpoint,
                      micro_groups or 1, os.path.join(work, f"trl_{tag}"))
    trl = run_child(cmd, TRL_LINE, os.path.join(work, f"trl_{tag}.log"))
    check_child(trl, f"TRL ({what})", args.steps)
    if trl_lengths(trl.log) != {float(C)}:
        sys.exit(f"bench_trl: TRL's completion lengths were {sorted(trl_lengths(trl.log))}, not "
                 f"{C} (see {trl.log})")
    print(f"  TRL    {what}: {progress(trl)}", flush=True)
    return Pair(P, checkpoint, micro_groups, engine, trl, split)


def progress(run: ChildRun) -> str:
    wall = " ".join(f"{s:.2f}" for s in run.per_step(0))
    cpu = " ".join(f"{s:.2f}" for s in run.per_step(1))
    return f"wall s/step {wall} | cpu s/step {cpu} | peak RSS {mib(run.peak_kib)} MiB"


def mib(kib: float) -> str:
    return f"{kib / 1024:,.0f}"


def setting(p: Pair) -> str:
    if p.checkpoint is None:
        return f"{'defaults':>11}"
    return f"{str(p.checkpoint).lower():>5} {p.micro_groups:>5}"


def print_times(pairs: list[Pair]) -> None:
    print("\nseconds per step, median of steps 2..N: wall clock, and CPU time of the process")
    print(f"{'P':>5} {'ckpt':>5} {'micro':>5} | {'engine':>7} {'TRL':>7} {'faster':>7} | "
          f"{'engine':>7} {'TRL':>7} {'faster':>7} | {'tokens':>7} | {'engine split':>13}")
    print(f"{'':>17} | {'wall':>23} | {'cpu':>23} | {'TRL/eng':>7} | {'roll / train':>13}")
    for p in pairs:
        tokens_engine, tokens_trl = train_tokens(p.P)
        split = f"{p.engine_split[0]:.2f} / {p.engine_split[1]:.2f}"
        print(f"{p.P:>5} {setting(p)} | {p.engine.wall():>7.2f} "
              f"{p.trl.wall():>7.2f} {p.trl.wall() / p.engine.wall():>6.1f}x | "
              f"{p.engine.cpu():>7.2f} {p.trl.cpu():>7.2f} {p.trl.cpu() / p.engine.cpu():>6.1f}x | "
              f"{tokens_trl / tokens_engine:>6.1f}x | {split:>13}")


def print_memory(pairs: list[Pair], base_engine: int, base_trl: int) -> None:
    print(f"\npeak RSS in MiB; import baseline: engine {mib(base_engine)}, TRL {mib(base_trl)}")
    print(f"{'P':>5} {'ckpt':>5} {'micro':>5} | {'engine':>7} {'TRL':>7} {'less':>6} | "
          f"{'engine':>7} {'TRL':>7} {'less':>6}")
    print(f"{'':>17} | {'peak':>22} | {'peak over baseline':>22}")
    for p in pairs:
        over_engine = p.engine.peak_kib - base_engine
        over_trl = p.trl.peak_kib - base_trl
        print(f"{p.P:>5} {setting(p)} | {mib(p.engine.peak_kib):>7} "
              f"{mib(p.trl.peak_kib):>7} {p.trl.peak_kib / p.engine.peak_kib:>5.1f}x | "
              f"{mib(over_engine):>7} {mib(over_trl):>7} {over_trl / over_engine:>5.1f}x")

# -----------------------------------------------------------------------------
# Command line


def parse_bool_list(text: str) -> list[bool]:
    values = {"true": True, "false": False}
    try:
        return [values[v.strip().lower()] for v in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true/false separated by commas, got {text!r}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    global PROMPTS  # a module constant for every function here, the TRL worker's process too
    parser = argparse.ArgumentParser(description="engine vs TRL GRPOTrainer, side by side")
    parser.add_argument("--P", default="64,512", help="prompt lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (>= 2; step 1 "
                        "is warm-up and not counted)")
    parser.add_argument("--checkpoint", type=parse_bool_list, default=[True, False],
                        help="activation checkpointing on both sides: true,false")
    parser.add_argument("--micro_groups", default="1,16", help="groups of G completions per "
                        "forward/backward on both sides, comma-separated (1: TRL's default; "
                        f"{PROMPTS}: the whole generation batch)")
    parser.add_argument("--quick", action="store_true", help="P 64, 3 steps, checkpointing on")
    parser.add_argument("--defaults", action="store_true", help="one more pair per P: each side at "
                        "its defaults (the engine's flags left out, TRL's checkpointing on and one "
                        "group per micro-batch)")
    parser.add_argument("--only_defaults", action="store_true", help="that pair alone")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, runs)")
    parser.add_argument("--model", default="", help="a Hugging Face checkpoint directory "
                        "(default: the random tiny Llama written here)")
    parser.add_argument("--num_prompts", type=int, default=PROMPTS, help="prompts per step")
    # the TRL worker's own options (this file re-run in a fresh process)
    parser.add_argument("--worker", choices=("trl", "trl-imports"), help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    PROMPTS = args.num_prompts
    try:
        args.micro_groups = [int(m) for m in args.micro_groups.split(",")]
    except ValueError:
        parser.error(f"--micro_groups expects integers separated by commas, got "
                     f"{args.micro_groups!r}")
    if args.worker == "trl":
        args.checkpoint = args.checkpoint[0]
        args.micro_groups = args.micro_groups[0]
        return args
    if args.quick:
        args.P = "64"
        args.steps = 3
        args.checkpoint = [True]
    try:
        args.P = [int(p) for p in args.P.split(",")]
    except ValueError:
        parser.error(f"--P expects integers separated by commas, got {args.P!r}")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: needs >= 2 (step 1 is warm-up, not counted)")
    if any(m < 1 or PROMPTS % m for m in args.micro_groups):
        parser.error(f"--micro_groups {args.micro_groups}: each must divide {PROMPTS}")
    if min(args.P) < 1 or max(args.P) + C > 2048:
        parser.error(f"--P {args.P}: each needs 1 <= P and P + {C} <= 2048 (max positions)")
    return args


def versions() -> str:
    import torch
    import transformers
    import trl
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"trl {trl.__version__}")


def main(args: argparse.Namespace) -> None:
    print(f"engine vs TRL GRPOTrainer on {args.model or 'a random tiny Llama'}: "
          f"{PROMPTS} prompts x G={G}, C={C} new tokens (no early "
          f"stop), P={args.P}, {args.steps} steps each (median of steps 2..{args.steps}), "
          f"1 thread each; {versions()}")
    print(f"micro-batch: engine --micro_batch_groups m = TRL per_device_train_batch_size {G}m, "
          f"gradient_accumulation_steps {PROMPTS}/m, m in {args.micro_groups} (one generation of "
          f"{PROMPTS * G} completions per step)")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    work = tempfile.mkdtemp(prefix="bench_trl_")
    model_dir = os.path.join(work, "model")
    if args.model:
        link_checkpoint(args.model, model_dir)
    else:
        write_checkpoint(model_dir)
    base_engine = import_baseline_kib("engine", os.path.join(work, "import_engine.log"))
    base_trl = import_baseline_kib("trl", os.path.join(work, "import_trl.log"))
    settings = [] if args.only_defaults else list(itertools.product(args.checkpoint,
                                                                     args.micro_groups))
    settings += [(None, None)] if args.defaults or args.only_defaults else []
    pairs = [measure_pair(work, model_dir, P, checkpoint, m, args)
             for P in args.P for checkpoint, m in settings]
    print_times(pairs)
    print_memory(pairs, base_engine, base_trl)
    print(f"load average at end: {os.getloadavg()[0]:.1f} (the machine is shared: compare ratios)")
    if args.keep:
        print(f"logs and runs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    cli = parse_args(sys.argv[1:])
    if cli.worker == "trl-imports":
        trl_imports()
    elif cli.worker == "trl":
        trl_worker(cli)
    elif importlib.util.find_spec("trl") is None:
        print("bench_trl: trl is not importable here (pip install trl to run this benchmark, "
              "it is not a requirement of the engine); nothing measured")
    else:
        main(cli)
