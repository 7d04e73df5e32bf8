"""Train the Cora GAT with DistributedDataParallel, one process per GPU (NCCL)
or per CPU worker (gloo), launched by torchrun.

Each process runs the full-graph forward and takes the loss over its own
share of the training nodes, scaled so that DDP's gradient average equals
the gradient of the mean loss over all training nodes (what one process
computes).

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py            # CPU, gloo
    torchrun --standalone --nproc_per_node N examples/train_ddp.py --device cuda  # N GPUs
    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --synthetic --epochs 5
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cora import GAT, LAYERS, load_data  # noqa: E402

from pyg_fastattn import prepare  # noqa: E402
from pyg_fastattn.datasets import DatasetNotFoundError  # noqa: E402


def shard(train_idx, rank, world):
    """This rank's training nodes (a strided share)."""
    return train_idx[rank::world]


def local_loss(out, y, idx, num_train, world):
    """Sum of this rank's losses / num_train * world: DDP's average over the
    ranks is then the mean loss over all training nodes."""
    return F.cross_entropy(out[idx], y[idx], reduction='sum') * (world / num_train)


def main(argv=None, hard_exit=False):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--layer', default='fast', choices=sorted(LAYERS))
    p.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    p.add_argument('--epochs', type=int, default=200)
    p.add_argument('--dropout', type=float, default=0.6)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--root', default=None, help='Planetoid root (as train_cora)')
    p.add_argument('--synthetic', action='store_true',
                   help='PubMed-sized random graph instead of Cora')
    p.add_argument('--save-grads', default=None,
                   help='after one step, rank 0 saves the gradients here and '
                   'the run stops (used by the tests)')
    args = p.parse_args(argv)

    cuda = args.device == 'cuda'
    dist.init_process_group('nccl' if cuda else 'gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get('LOCAL_RANK', rank))
        torch.cuda.set_device(local)
        device = torch.device('cuda', local)
    else:
        device = torch.device('cpu')
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        data, name = load_data('Cora', args.root, args.synthetic)
    except DatasetNotFoundError as e:
        if rank == 0:
            print(e, file=sys.stderr)
        dist.destroy_process_group()
        return 2
    data = data.to(device)
    # the fast layers take the graph prepared once; PyG's, the edge_index
    graph = (prepare(data.edge_index, num_nodes=data.num_nodes)
             if args.layer == 'fast' else data.edge_index)
    train_idx = data.train_mask.nonzero().view(-1)
    idx = shard(train_idx, rank, world)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GAT(LAYERS[args.layer], data.num_features, 8,
                int(data.y.max()) + 1, dropout=args.dropout).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.005, weight_decay=5e-4)
    torch.manual_seed(args.seed + 1000 * rank)  # independent dropout masks
    if rank == 0:
        print(f'{name}: {world} processes ({"NCCL" if cuda else "gloo"}), '
              f'layer {args.layer}, {train_idx.numel()} training nodes')
    times = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        ddp.train()
        opt.zero_grad(set_to_none=True)
        loss = local_loss(ddp(data.x, graph), data.y, idx, train_idx.numel(),
                          world)
        loss.backward()
        if args.save_grads:
            if rank == 0:
                torch.save({n: q.grad.cpu() for n, q in model.named_parameters()},
                           args.save_grads)
            break
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if epoch % 20 == 0 or epoch == args.epochs:
            total = loss.detach().clone()
            dist.all_reduce(total)  # every rank takes part
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    pred = model(data.x, graph).argmax(-1)
                mask = data.test_mask
                acc = (pred[mask] == data.y[mask]).float().mean().item()
                med = sorted(times)[len(times) // 2] * 1e3
                print(f'epoch {epoch:4d}  loss {total.item() / world:.4f}  '
                      f'test acc {acc:.4f}  {med:.2f} ms/epoch (median)',
                      flush=True)
    dist.destroy_process_group()
    if hard_exit:
        # Leave before `ddp` is freed: its reducer holds the gloo process
        # group, whose destructor joins gloo's worker threads with the GIL
        # held, while a worker still releasing a finished allreduce waits
        # for the GIL (a hang at exit, seen on a loaded 2-core machine).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == '__main__':
    sys.exit(main(hard_exit=True))
