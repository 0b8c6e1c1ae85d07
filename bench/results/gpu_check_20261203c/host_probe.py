"""Probe (device): host cost per uncaptured call of tier (b)'s op vs Inductor's all_reduce_ + wait_tensor, one-rank NCCL."""
import os, time, statistics, json, sys, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
name = dist.group.WORLD.group_name
from fxfuse.op.runtime.registration import install_native_fallback
print("installed", install_native_fallback(), file=sys.stderr)
hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 7168
torch.ops.fxfuse_native.register_all_reduce(name, 1, hidden, torch.bfloat16)
buf = torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda")
ar, wait = torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.wait_tensor.default
op = torch.ops.fxfuse.all_reduce_.default
run = torch.ops.fxfuse_native.run_all_reduce.default
reset = torch.ops.fxfuse_native.reset_counts.default
fns = {"inductor_ar_wait": lambda: wait(ar(buf, "sum", name)), "ar_only": lambda: ar(buf, "sum", name),
       "op_bound": lambda: op(buf, name), "op_lookup": lambda: torch.ops.fxfuse.all_reduce_.default(buf, name),
       "cpp_direct": lambda: run(buf, name, True), "empty_cpp_op": lambda: reset()}
for f in fns.values():
    for _ in range(200): f()
torch.cuda.synchronize()
res = {k: [] for k in fns}
for r in range(40):
    for k, f in fns.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300): f()
        res[k].append((time.perf_counter() - t) / 300 * 1e6)
        torch.cuda.synchronize()
out = {k: [round(statistics.median(v), 3), round(statistics.quantiles(v, n=4)[0], 3), round(statistics.quantiles(v, n=4)[2], 3)] for k, v in res.items()}
print(json.dumps({"hidden": hidden, "torch": torch.__version__, "median_p25_p75_us": out}, indent=1))
if os.environ.get("PROBE_PROFILE"):
    from torch.profiler import profile, ProfilerActivity
    for k in ("inductor_ar_wait", "op_bound"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(200): fns[k]()
        print(k); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
dist.destroy_process_group()
