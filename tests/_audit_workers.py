"""Workers for tests/test_sharding_audit.py: one launch, every case on every rank."""
import torch

from tensorpar import distributed as dist


def audit_worker():
    import tensorpar
    from tensorpar.models.generation import generate
    from tensorpar.models.tiny import make_tiny_model
    from tensorpar.sharding.audit import ReplicaDriftError, check_same_inputs
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = tensorpar.parallelize(make_tiny_model("llama"))
    out = {"fresh": tensorpar.audit(model)}
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.sum().backward()
    out["after_backward"] = tensorpar.audit(model, grads=True)
    norm, up = model.model.norm.weight, model.model.layers[0].mlp.up_proj.weight
    saved = norm.detach().clone(), up.detach().clone()
    with torch.no_grad():
        if rank == 1:
            norm.add_(1e-7)  # a replicated weight, off in its last bits
            up.add_(1.0)  # a shard: differs between ranks by design
    out["drifted"] = tensorpar.audit(model)
    try:
        tensorpar.audit(model, raise_on_drift=True)
        out["raised"] = None
    except ReplicaDriftError as exc:
        out["raised"] = str(exc)
    with torch.no_grad():
        norm.copy_(saved[0])
        up.copy_(saved[1])
    with torch.no_grad():
        if rank == 1:
            model.model.layers[1].input_layernorm.weight.grad.mul_(2)  # a gradient not reduced alike
    out["grad_drift"] = tensorpar.audit(model, grads=True)
    mine = ids if rank == 0 else ids.flip(1)
    for name, call in (("inputs", lambda: check_same_inputs(None, input_ids=mine)),
                       ("generate", lambda: generate(model, mine, 2))):
        try:
            call()
            out[name] = None
        except ReplicaDriftError as exc:
            out[name] = str(exc)
    return {k: (v.ok, v.checked, v.differs) if hasattr(v, "differs") else v for k, v in out.items()}


def deepcopy_worker():
    """A deep copy of a parallelized model keeps what each parameter is (torch's
    Parameter.__deepcopy__ drops attributes): the copy's gradient norm equals the original's
    (replicated tensors counted once) and its audit sees shards as shards."""
    import copy

    import tensorpar
    from tensorpar.models.tiny import make_tiny_model
    from tensorpar.models.training import clip_grad_norm_
    model = tensorpar.parallelize(make_tiny_model("llama"))
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    norms = []
    for m in (model, twin):
        m(input_ids=ids).logits.pow(2).mean().backward()
        norms.append(clip_grad_norm_(m, 1e9).item())
    return norms, tensorpar.audit(twin, grads=True).ok, tensorpar.audit(twin).checked == tensorpar.audit(model).checked


def training_audit_worker():
    """train_step(audit=True): a clean step passes; one rank's optimizer with another learning
    rate makes the replicated norms drift, named after that step; different batches are refused
    before it."""
    import tensorpar
    from tensorpar.models.tiny import make_tiny_model
    from tensorpar.models.training import train_step
    from tensorpar.sharding.audit import ReplicaDriftError
    model = tensorpar.parallelize(make_tiny_model("llama"))
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out["clean"] = train_step(model, opt, ids, audit=True)["loss"] > 0
    for name, step in (("lr", lambda: train_step(model, torch.optim.SGD(model.parameters(),
                                                                          lr=1e-2 * (1 + dist.get_rank())),
                                                 ids, audit=True)),
                       ("batch", lambda: train_step(model, opt, ids if dist.get_rank() == 0 else ids.flip(1),
                                                    audit=True)),
                       ("default", lambda: train_step(model, opt, ids if dist.get_rank() == 0 else ids.flip(1)))):
        try:
            step()
            out[name] = None
        except ReplicaDriftError as exc:
            out[name] = str(exc)
    return out
