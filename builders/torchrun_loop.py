"""Recipe: build an influence index while training on several processes (torchrun, DDP or FSDP2).

    torchrun --nproc_per_node 2 builders/torchrun_loop.py --model MODEL_DIR --data train.jsonl --out my-index --wrap ddp
    torchrun --nproc_per_node 2 builders/torchrun_loop.py ... --wrap fsdp      # FSDP2 (fully_shard)

An ordinary data-parallel loop (a ``DistributedSampler`` gives each rank its rows); the capture adds
the ``with`` block and the batch's ``gradindex_row``. Each rank captures its own examples from
activations and output gradients (however FSDP shards the parameters) into ``OUT/capture/rank-R``;
when the block ends, rank 0 assembles every rank's rows into one store (rows by data set id) and
writes the manifest. Backend gloo on CPUs, nccl on GPUs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402

from gradindex.data import collate, load_records, tokenize_records  # noqa: E402
from gradindex.integrations import GradIndexCapture  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402


def wrap(model: torch.nn.Module, how: str, device: torch.device) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--wrap", choices=["ddp", "fsdp"], default="ddp")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model, tok = load_causal_lm(args.model, device=str(device))
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    model = wrap(model, args.wrap, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = torch.utils.data.DistributedSampler(range(len(data)), num_replicas=world, rank=rank,
                                                  shuffle=True, seed=args.seed)
    model_out = args.model_out or args.out.rstrip("/") + "-model"
    model.train()
    with GradIndexCapture(model, args.out, optimizer=opt, projection=args.projection, num_rows=len(data),
                          max_length=args.max_length, model_id=os.path.abspath(model_out),
                          data_id=os.path.abspath(args.data)) as cap:
        for epoch in range(args.epochs):
            cap.epoch = epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
            batches = [order[s:s + args.batch_size] for s in range(0, len(order), args.batch_size)]
            for k, rows in enumerate(batches):
                batch = collate([data.input_ids[i] for i in rows], [data.labels[i] for i in rows], tok.pad_token_id)
                batch = {name: t.to(device) for name, t in batch.items()}
                batch["gradindex_row"] = torch.tensor(rows)  # the capture takes it; the model never sees it
                loss = model(**batch).loss / args.accum
                loss.backward()
                if (k + 1) % args.accum == 0 or k + 1 == len(batches):
                    opt.step()
                    opt.zero_grad()
    if args.wrap == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.module.state_dict()
    if rank == 0:
        inner = model.module if args.wrap == "ddp" else model
        inner.save_pretrained(model_out, state_dict=state)
        tok.save_pretrained(model_out)
        m = cap.manifest
        print(f"captured {m['counts']['examples']} examples over {m['training']['steps']} steps on {world} ranks "
              f"({args.wrap}) into {args.out}; model saved to {model_out}")
    dist.barrier()  # no work in flight when the group goes (builders/hf_trainer.py)
    dist.destroy_process_group()
    from gradindex.distributed import exit_rank

    exit_rank(0)  # (gloo threads can abort the interpreter teardown: "terminate called without an active exception")


if __name__ == "__main__":
    main()
