"""Command line: ``mstar serve <model>``, ``mstar-serve --config FILE``, ``mstar models``,
``mstar check-config FILE``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    from mstar.config import ConfigError, Placement, load_config
    from mstar.deploy import cli as deploy_cli
    from mstar.devices import placement_line, resolve_gpus
    from mstar.env import settings
    from mstar.launcher import LaunchError, LaunchOptions, Mesh, run_forever
    from mstar.layouts import models_text, resolve, serve_target
    from mstar.models.base import MissingAssets, Model
    from mstar.models.graph import Modality
    from mstar.models.hub import CheckpointError
    from mstar.models.registry import UnknownModel, create_model, known_models
    from mstar.netif import transfer_address
    from mstar.nvtx import NvtxUnavailable, require_cuda
    from mstar.ports import PortInUse
    from mstar.services.transport import PROTOCOL_HELP, mooncake, parse_protocol
    from mstar.shm_names import check_prefix
except ModuleNotFoundError as _e:  # run from a checkout without its dependencies installed
    raise SystemExit(f"mstar: {_e}: M*'s dependencies are not installed for {sys.executable}. Run `make setup` in the "
                     f"checkout (or pip install -e '.[all]')") from None


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="placement YAML, or a shipped layout's name: 'pd_disaggregated', "
                                    "'orpheus_pd_disaggregated', 'orpheus_single_gpu' (`mstar models` lists them; "
                                    "default: the model's configs/default.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds (default 127.0.0.1: nothing is "
                                                       "reachable from other hosts unless you say so)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="conductor gRPC port (0: any free port)")
    p.add_argument("--gpus", help="comma-separated CUDA device ids that YAML ranks map onto, e.g. 0,1 (default: every "
                                  "GPU torch sees; '' or no CUDA: the CPU)")
    p.add_argument("--cache-dir", help="directory holding model weights, looked at first (HF hub cache layout "
                                       "models--org--name/snapshots/..., or org/name folders); then HF_HUB_CACHE, "
                                       "HF_HOME/hub, ~/.cache/huggingface/hub")
    p.add_argument("--download", action="store_true",
                   help="download checkpoints missing from the local caches (Hugging Face hub, with a progress bar) into "
                        "--cache-dir or the HF cache; also MSTAR_DOWNLOAD=1")
    p.add_argument("--random-weights", action="store_true",
                   help="demo mode: serve a tiny RANDOM checkpoint written in the real layout (no real weights needed; "
                        "its output means nothing)")
    p.add_argument("--tensor-comm-protocol", default="AUTO", help=PROTOCOL_HELP)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--max-inflight", type=int, default=1024, help="conductor admission limit (requests in flight)")
    p.add_argument("--request-timeout", "--timeout", dest="request_timeout", type=float, default=300.0,
                   help="default per-request timeout in seconds (default 300)")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long each service may take to report healthy: loading its checkpoint, compiling and "
                        "capturing CUDA graphs (default 900; the launcher says every 30 s what it waits for)")
    p.add_argument("--envoy", action="store_true", help="also run an Envoy front proxy fed by the xDS control plane")
    p.add_argument("--envoy-port", type=int, default=10000, help="Envoy's port for REST and gRPC (0: any free port)")
    p.add_argument("--enable-nvtx", action="store_true",
                   help="NVTX ranges around node forwards, engine steps and tensor transfers in every service, for a "
                        "GPU profiler (needs CUDA; also MSTAR_NVTX=1; default off)")
    p.add_argument("--torch-profile", metavar="DIR",
                   help="arm a torch.profiler trace in each node group and the conductor: SIGUSR1 to its process starts a recording "
                        "(CPU ops of every thread, CUDA kernels, the NVTX spans as ranges), the next SIGUSR1 or "
                        "MSTAR_TORCH_PROFILE_S seconds (default 10) ends it; written as "
                        "<group or conductor>-<pid>-<k>.trace.json.gz and .ops.txt into DIR (also MSTAR_TORCH_PROFILE=DIR; "
                        "default off; bench/trace_gaps.py summarises one)")
    p.add_argument("--socket-path-prefix", metavar="PREFIX",
                   help="prefix of this mesh's shared-memory segment names in /dev/shm (default mstar-<launcher "
                        "pid>-); meshes sharing a host or /dev/shm need prefixes that do not overlap")
    p.add_argument("--upload-dir", metavar="DIR",
                   help="spill uploaded files larger than --upload-spill-mb to DIR instead of holding them in the "
                        "gateway's memory; removed when each request ends (default: no spilling)")
    p.add_argument("--upload-spill-mb", type=float, default=1.0, help="with --upload-dir: a file part larger than "
                                                                      "this goes to disk (MiB, default 1)")
    p.add_argument("--upload-dir-max-mb", type=float, default=1024.0,
                   help="with --upload-dir: the most spilled uploads the gateway keeps there at once; a request that "
                        "would pass it gets 413 RESOURCE_EXHAUSTED (MiB, default 1024)")
    p.add_argument("--mooncake-port", type=int, metavar="PORT",
                   help="Mooncake engines listen on PORT and up, two ports per node group and conductor (default: "
                        "each engine picks from 15000-17000)")
    p.add_argument("--tls-dir", metavar="DIR|auto",
                   help="internal gRPC (node groups, the conductor's internal port) is always mutual TLS; by default "
                        "('auto') with a CA made in memory for this mesh and never written to disk. DIR: the "
                        "certificate in DIR instead (ca.pem, cert.pem, key.pem; `mstar tls init DIR` makes them), so "
                        "replicas started by hand can join")
    p.add_argument("--insecure-internal", action="store_true",
                   help="internal gRPC in PLAINTEXT instead (development only; loopback binds only): any local "
                        "process can then join the mesh, read requests and send it frames")
    p.add_argument("--api-keys-file", metavar="PATH",
                   help="API keys the gateway and the conductor's public API require (one per line; also "
                        "MSTAR_API_KEYS, comma-separated); clients send 'Authorization: Bearer <key>'. Default: open")
    p.add_argument("--per-key-max-inflight", type=int, default=0, metavar="N",
                   help="most in-flight requests per API key (0: no limit); past it 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--tcp-transfer-device", metavar="IFACE|IP",
                   help="network interface (or IPv4 address) the node groups bind, so their tensor links and "
                        "Mooncake sessions use it (default: --host)")


def _serve_settings(args: argparse.Namespace) -> dict:
    """The launch options of the serve flags that need checking before anything starts."""
    out: dict = {"nvtx": args.enable_nvtx or settings().nvtx}
    if out["nvtx"]:
        require_cuda()
    profile = args.torch_profile or settings().torch_profile
    if profile:
        out["torch_profile"] = str(Path(profile).expanduser().resolve())
    if args.socket_path_prefix is not None:
        out["shm_prefix"] = check_prefix(args.socket_path_prefix)
    if args.upload_dir is not None:
        path = Path(args.upload_dir).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--upload-dir {args.upload_dir}: cannot create it: {e.strerror or e}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--upload-dir {args.upload_dir}: not writable by this user; pass a folder it may write")
        out.update(upload_dir=str(path), upload_spill_mb=args.upload_spill_mb, upload_dir_max_mb=args.upload_dir_max_mb)
    if args.mooncake_port is not None:
        if parse_protocol(args.tensor_comm_protocol).value in ("TCP", "SHM"):
            raise ValueError(f"--mooncake-port: --tensor-comm-protocol {args.tensor_comm_protocol} never uses "
                             "Mooncake; drop one of them")
        if not mooncake.available():
            raise ValueError(f"--mooncake-port: {mooncake.unavailable_reason()}")
        out["mooncake_port"] = args.mooncake_port
        where = args.tcp_transfer_device or args.host
        if parse_protocol(args.tensor_comm_protocol).value == "AUTO" and where in ("127.0.0.1", "localhost", "lo"):
            print(f"mstar: note: --mooncake-port: services on {where} start no Mooncake engine (AUTO moves tensors "
                  "between them by shared memory); it takes effect with --host or --tcp-transfer-device on another "
                  "address, or --tensor-comm-protocol RDMA", file=sys.stderr)
    if args.tcp_transfer_device is not None:
        out["transfer_address"] = transfer_address(args.tcp_transfer_device)
    if args.per_key_max_inflight < 0:
        raise ValueError(f"--per-key-max-inflight must be >= 0, got {args.per_key_max_inflight}")
    out.update(tls_dir=args.tls_dir, insecure_internal=args.insecure_internal, api_keys_file=args.api_keys_file,
               per_key_max_inflight=args.per_key_max_inflight)
    return out


#: what a random checkpoint's output is, per kind of output
_RANDOM_OUTPUT = {Modality.TEXT: "text: random tokens", Modality.IMAGE: "images: noise, not pictures",
                  Modality.AUDIO: "audio: noise, not speech", Modality.ACTION: "actions: random, not a trained model's",
                  Modality.LATENT: "embeddings: random, not a trained encoder's"}


def random_weights_line(model: Model, cache_dir: str, written: list[str]) -> str:
    """The --random-weights warning: where the checkpoint is and what the model's outputs then are."""
    if type(model).write_random_weights is Model.write_random_weights:  # the toy: nothing to write
        return f"mstar: note: --random-weights: '{model.name}' has no weights; it serves as always"
    kinds = "; ".join(_RANDOM_OUTPUT[m] for m in Modality if m in model.outputs.values())
    return (f"mstar: WARNING: --random-weights: serving a tiny RANDOM '{model.name}' checkpoint from {cache_dir} "
            f"({'written now: ' + ', '.join(written) if written else 'already there'}); its output means nothing "
            f"({kinds})")


def _launch(args: argparse.Namespace, config_path: Path) -> int:
    try:
        parse_protocol(args.tensor_comm_protocol)
        checked = _serve_settings(args)
        config = load_config(config_path)
        gpus = resolve_gpus(args.gpus, config.node_groups)
        cache_dir = args.cache_dir
        if args.random_weights:
            cache_dir = cache_dir or str(Path.home() / ".cache" / "mstar" / "random-weights")
            model = create_model(config.model, config.model_kwargs, cache_dir)
            print(random_weights_line(model, cache_dir, model.write_random_weights(cache_dir)), file=sys.stderr,
                  flush=True)
        opts = LaunchOptions(config_path, args.host, args.port, args.grpc_port, gpus, cache_dir,
                             args.tensor_comm_protocol.upper(), args.log_level, args.max_inflight, args.request_timeout,
                             startup_timeout_s=args.startup_timeout, envoy=args.envoy, envoy_port=args.envoy_port,
                             download=args.download or settings().download, **checked)
        print(placement_line(config.node_groups, gpus, args.gpus), file=sys.stderr, flush=True)
        return run_forever(lambda: Mesh(config, opts))
    except (ConfigError, UnknownModel, LaunchError, ValueError, FileNotFoundError, MissingAssets, PortInUse,
            CheckpointError, NvtxUnavailable) as e:
        print(f"mstar: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="mstar", description="M*: serve composite multimodal models as a gRPC mesh")
    sub = p.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="serve a model: node groups, conductor and REST gateway")
    serve.add_argument("model", help=f"model name ({', '.join(known_models())}), or a layout name such as "
                                     "orpheus_pd_disaggregated")
    _serve_args(serve)
    sub.add_parser("models", help="list registered models and the layouts each ships")
    deploy_cli.add_parser(sub)
    check = sub.add_parser("check-config", help="validate a placement YAML against its model")
    check.add_argument("config")
    tls_cmd = sub.add_parser("tls", help="certificates for mutual TLS between the mesh's services")
    tls_sub = tls_cmd.add_subparsers(dest="tls_cmd", required=True)
    init = tls_sub.add_parser("init", help="write a new CA's certificate and a mesh certificate (ca.pem, cert.pem, "
                                           "key.pem) into DIR; the CA's key is not kept")
    init.add_argument("dir")
    init.add_argument("--host", action="append", default=[], help="another DNS name or IP the certificate names "
                                                                   "(repeatable; every channel also accepts "
                                                                   "'mstar.internal')")
    init.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    args = p.parse_args(argv)
    if args.cmd == "tls":
        from mstar import tls as mtls

        out = mtls.write_mesh_ca(args.dir, args.host, args.days)
        print(f"mstar: wrote a CA and a mesh certificate to {out} (keep key.pem secret; give every service "
              f"--tls-dir {out}; the CA's key was not kept: a new certificate needs a new `mstar tls init`)")
        sys.exit(0)
    if args.cmd == "deploy":
        sys.exit(deploy_cli.main(args))
    if args.cmd == "models":
        print(models_text())
        sys.exit(0)
    if args.cmd == "check-config":
        try:
            cfg = load_config(args.config)
            placement = Placement(cfg, create_model(cfg.model, cfg.model_kwargs))
        except (ConfigError, UnknownModel, ValueError) as e:
            print(f"mstar: {e}", file=sys.stderr)
            sys.exit(2)
        for walk in placement.model.walks:
            print(f"walk {walk}: node groups {', '.join(placement.fragments(walk))}")
        sys.exit(0)
    try:
        model, config_path = serve_target(args.model, args.config)
        if load_config(config_path).model != model:
            raise ConfigError(f"{config_path} serves model '{load_config(config_path).model}', not '{model}'")
    except (ConfigError, UnknownModel, FileNotFoundError) as e:
        print(f"mstar: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(_launch(args, config_path))


def serve_main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="mstar-serve", description="Serve the model of a placement YAML")
    _serve_args(p)
    args = p.parse_args(argv)
    if not args.config:
        p.error("--config is required")
    try:
        config_path = resolve(args.config)
    except (ConfigError, UnknownModel) as e:
        print(f"mstar: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(_launch(args, config_path))


if __name__ == "__main__":
    main()
