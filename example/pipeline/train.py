"""Train the example GPT with pipeline parallelism (GPipe or 1F1B).

Run with torchrun --nproc_per_node N (or python, one process: one stage);
flags: --help. The GPT is cut into --stages stages (default: one per rank),
balanced by parameter count; with N = stages × replicas, each replica takes
--batch-size sequences per step, in --microbatches micro-batches.

With --hf and a Llama --model (llama-tiny, llama-small), the model is
transformers' LlamaForCausalLM of that shape, built here from its config with
the example Llama's initial weights (nothing is downloaded), and cut by
decoder layers with tiny_zero.pipeline.pipeline_stages.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from example import train_common as common
from example import hf
from example.model import CONFIGS, LlamaConfig, build_model, build_sequential, loss_fn
from tiny_zero.distributed import init_distributed
from tiny_zero.pipeline import Pipeline, PipelineAdamW
from tiny_zero.pipeline.stages import pipeline_stages


def pipeline_flags(p):
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default: 4)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="the order of forwards and "
                   "backwards (default: 1f1b)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per rank)")
    p.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM of a Llama --model's shape "
                   "and initial weights, cut by decoder layers (needs transformers)")


def hf_llama_stages(args):
    """--hf: the Llama --model as transformers' LlamaForCausalLM (the example
    Llama names its parameters as it does), in pipeline_stages."""
    c = CONFIGS.get(args.model)
    if not isinstance(c, LlamaConfig):
        raise SystemExit(f"error: --hf builds transformers' Llama of a Llama --model's shape, not {args.model}")
    transformers = hf.transformers_or_exit()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        max_position_embeddings=c.block_size, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings))
    model.load_state_dict(build_model(args.model, seed=args.seed).state_dict())
    if args.checkpoint_activations:  # each decoder layer recomputed in backward
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return pipeline_stages(model, args.stages or init_distributed()[1])


def main():
    args = common.parse_args(__doc__, add_flags=pipeline_flags)
    data = common.load_data(args)
    with common.Run(args, data) as run:
        if args.hf:
            seq = hf_llama_stages(args)
        else:
            seq = build_sequential(args.model, seed=args.seed, device="meta",  # each rank materialises its stage
                                   checkpoint_activations=args.checkpoint_activations)
        model = Pipeline(seq, loss_fn, microbatches=args.microbatches, schedule=args.schedule, stages=args.stages,
                         **common.strategy_options(args))
        opt = PipelineAdamW(model, common.param_groups(model.module, args), lr=args.lr)
        sched = common.schedule(opt, args)
        for step in run.steps(model, opt, sched):
            x, y = run.batch(step)
            loss = model.train_step(x, y)  # forward and backward of every micro-batch
            if run.skip(loss, step):
                opt.zero_grad()
                continue
            model.clip_grad_norm_(common.MAX_GRAD_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
            run.log(step, loss)
        run.finish()


if __name__ == "__main__":
    main()
