"""Workflow commands: init, digest-bootstrap, lock, build, run, verify, bundle, inspect, and the
``--config`` option of ``serve``.

Each command is thin: it parses options, calls the workflow module, prints one line per result (or JSON)
and returns the exit code. Errors of the package become one line on stderr with exit code 2 (cli.main).
``verify`` exits 0 for ``conformant`` and 1 for any other grade.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deterministic_inference.cli.serve_manifest import extend_serve
from deterministic_inference.errors import WorkflowError


def register(subparsers: Any) -> None:
    """Adds the workflow commands."""
    _init(subparsers)
    _bootstrap(subparsers)
    _lock(subparsers)
    _build(subparsers)
    _run(subparsers)
    _verify(subparsers)
    _bundle(subparsers)
    _inspect(subparsers)
    extend_serve(subparsers)


def _config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="manifest file (JSON or YAML)")


def _lock_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lock", type=Path, default=None,
                        help="lock file (default: <manifest>.lock.json next to the manifest)")


def _init(subparsers: Any) -> None:
    parser = subparsers.add_parser("init", help="write a manifest (default: the embedded model, greedy)")
    parser.add_argument("--output", required=True, type=Path, help="manifest file to write (.json or .yaml)")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF file, HF directory, or a directory of GGUF files (see --model-file)")
    parser.add_argument("--model-id", default=None,
                        help="Hugging Face model id ORG/NAME, found offline in the local Hugging Face cache "
                        "($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub); instead of --model. "
                        "ORG/NAME:QUANT picks the GGUF of a *-GGUF repository whose name contains QUANT "
                        "(case-insensitive), e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    parser.add_argument("--model-file", default=None, metavar="NAME",
                        help="the GGUF file to use from the --model directory or --model-id snapshot (one "
                        "file per quantization); recorded as model.source.file")
    parser.add_argument("--model-revision", default=None,
                        help="revision of --model-id: a commit hash, or a branch / tag the cache knows "
                        "(default: main)")
    parser.add_argument("--n-prompts", type=int, default=8, help="reference prompts to run (1-100)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    """`detinf init`."""
    from deterministic_inference.workflow.manifest import load_manifest
    from deterministic_inference.workflow.scaffold import HubModel, init_manifest, write_document

    if args.output.exists() and not args.force:
        raise WorkflowError(f"--output {args.output}: already exists; pass --force to overwrite")
    model: Path | HubModel | None = args.model
    if args.model_id is not None:
        if args.model is not None:
            raise WorkflowError("--model-id: give either --model PATH or --model-id ID, not both")
        repo, colon, quant = args.model_id.partition(":")
        if colon and not quant:
            raise WorkflowError(f"--model-id {args.model_id}: empty quant tag after ':'; write "
                                "ORG/NAME:QUANT (e.g. :Q4_K_M) or drop the ':'")
        if quant and args.model_file is not None:
            raise WorkflowError(f"--model-file: give either --model-file or the :{quant} of --model-id, "
                                "not both")
        model = HubModel(repo, args.model_revision or "main", quant or None)
    elif args.model_revision is not None:
        raise WorkflowError("--model-revision: needs --model-id (the revision of which model?)")
    elif args.model_file is not None and args.model is None:
        raise WorkflowError(f"--model-file {args.model_file}: needs --model DIR or --model-id ID (the "
                            "directory or snapshot that holds it)")
    document = init_manifest(model, args.n_prompts, args.max_tokens, args.model_file)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_document(args.output, document)
    manifest = load_manifest(args.output)
    print(f"wrote {args.output} (manifest {manifest.manifest_id})")
    return 0


def _bootstrap(subparsers: Any) -> None:
    parser = subparsers.add_parser("digest-bootstrap", help="fill sha256:unset digests of a manifest")
    _config(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--in-place", action="store_true",
                       help="write the filled digests back into --config (the default)")
    where.add_argument("--output", type=Path, default=None,
                       help="write the filled manifest to this file instead (next to --config)")
    parser.add_argument("--replace-existing", action="store_true",
                        help="re-hash every file, not only the sha256:unset ones")
    parser.add_argument("--write-lock", action="store_true",
                        help="then write the lock as `detinf lock` does (next to the manifest)")
    parser.set_defaults(func=cmd_bootstrap)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """`detinf digest-bootstrap`."""
    from deterministic_inference.workflow.scaffold import digest_bootstrap

    target = args.output or args.config
    changed = digest_bootstrap(args.config, args.output, args.replace_existing)
    for line in changed:
        print(line)
    print(f"{target}: {len(changed)} digest(s) "
          "filled" if changed else f"{target}: no unset digests")
    if args.write_lock:
        _write_lock(target, None)
    return 0


def _lock(subparsers: Any) -> None:
    parser = subparsers.add_parser("lock", help="hash artifacts, resolve the runtime closure, write the lock")
    _config(parser)
    parser.add_argument("--output", type=Path, default=None, help="lock file to write (default: next to it)")
    parser.set_defaults(func=cmd_lock)


def cmd_lock(args: argparse.Namespace) -> int:
    """`detinf lock`."""
    _write_lock(args.config, args.output)
    return 0


def _write_lock(config: Path, output: Path | None) -> None:
    from deterministic_inference.workflow.lock import create_lock, write_lock
    from deterministic_inference.workflow.manifest import load_manifest

    manifest = load_manifest(config)
    _warn(manifest.warnings)
    lock = create_lock(manifest)
    path = output or manifest.default_lock_path()
    write_lock(path, lock)
    print(f"wrote {path} (lock {lock['lock_id']})")


def _build(subparsers: Any) -> None:
    parser = subparsers.add_parser("build", help="emit closure metadata of this environment for a manifest")
    _config(parser)
    _lock_option(parser)
    parser.add_argument("--output", type=Path, default=None, help="closure JSON file (default: stdout)")
    parser.add_argument("--update-lock", action="store_true", help="record this closure in the lock")
    parser.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    """`detinf build`."""
    from deterministic_inference.workflow.manifest import load_manifest
    from deterministic_inference.workflow.rundir import json_bytes
    from deterministic_inference.workflow.scaffold import build_closure

    manifest = load_manifest(args.config)
    _warn(manifest.warnings)
    document = build_closure(manifest, args.lock, args.update_lock)
    if args.output:
        args.output.write_bytes(json_bytes(document))
    else:
        sys.stdout.write(json_bytes(document).decode())
    lock = document["lock"]
    if lock is not None:
        state = "updated" if lock.get("updated") else ("matches" if lock["matches"] else "differs from")
        print(f"closure {document['runtime_closure_digest']} {state} the lock "
              f"{lock['path']}", file=sys.stderr)
    return 0


def _run(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="run a locked manifest and write its run directory")
    _config(parser)
    _lock_option(parser)
    parser.add_argument("--output-dir", "--run-dir", dest="output_dir", type=Path, default=None,
                        help="run directory (must not exist; default: the manifest's outputs.directory, "
                        "runs/<run_id> for `init --model-id` manifests)")
    parser.add_argument("--base-url", default=None, help="run against this OpenAI-compatible endpoint")
    parser.add_argument("--no-verify-artifact-digests", action="store_true",
                        help="skip hashing model files before loading (not recommended)")
    parser.add_argument("--ray-address", default=None,
                        help="split the requests over Ray actors on this cluster (host:port of its GCS, or "
                        "`local` for a local instance on loopback); same run directory as one process")
    parser.add_argument("--shards", type=int, default=None, help="with --ray-address: how many (default 2)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the interrupted run of this run directory from its checkpoint "
                        "(same manifest, lock, dataset and engine); the result is the uninterrupted run's")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (requests done/total, tokens/s, ETA)")
    parser.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """`detinf run`; with outputs.golden enabled, also verifies against the golden bundle."""
    from deterministic_inference.workflow.run import RunOptions, run_manifest

    options = RunOptions(output_dir=args.output_dir, base_url=args.base_url,
                         verify_artifact_digests=not args.no_verify_artifact_digests, lock_path=args.lock,
                         ray_address=args.ray_address, shards=args.shards, resume=args.resume,
                         quiet=args.quiet)
    run_dir = run_manifest(args.config, options)
    print(f"wrote {run_dir}")
    return _golden_check(run_dir, args.config.parent)


def _golden_check(run_dir: Path, manifest_dir: Path) -> int:
    from deterministic_inference.workflow.rundir import load_run_dir
    from deterministic_inference.workflow.verify import verify_paths, write_report

    manifest = load_run_dir(run_dir).manifest
    golden = manifest["outputs"]["golden"]
    if not golden["enabled"]:
        return 0
    if not golden["bundle"]:
        raise WorkflowError("$.outputs.golden.bundle: golden checks are enabled but no bundle is "
                            "named; set it")
    reference = Path(golden["bundle"])
    reference = reference if reference.is_absolute() else manifest_dir / reference
    report = verify_paths(reference, run_dir)
    report_dir = run_dir.with_name(run_dir.name + ".golden")
    write_report(report, report_dir)
    print(f"golden check against {reference}: {report['grade']} (report in {report_dir})")
    return 0 if report["grade"] == "conformant" else 1


def _verify(subparsers: Any) -> None:
    parser = subparsers.add_parser("verify", help="grade two runs (run dirs or bundles) against each other")
    parser.add_argument("--bundle-a", required=True, type=Path,
                        help="reference run: a run dir, the bundle.json inside one, or a .tar.gz bundle")
    parser.add_argument("--bundle-b", required=True, type=Path,
                        help="run to check: a run dir, the bundle.json inside one, or a .tar.gz bundle")
    parser.add_argument("--output-dir", type=Path, default=Path("."), help="where the report files go")
    parser.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """`detinf verify`: exit 0 when conformant, 1 otherwise."""
    from deterministic_inference.workflow.verify import summary_text, verify_paths, write_report

    report = verify_paths(args.bundle_a, args.bundle_b)
    write_report(report, args.output_dir)
    sys.stdout.write(summary_text(report))
    return 0 if report["grade"] == "conformant" else 1


def _bundle(subparsers: Any) -> None:
    parser = subparsers.add_parser("bundle", help="pack a run directory into a deterministic tar.gz")
    parser.add_argument("--run-dir", required=True, type=Path, help="complete run directory to pack")
    parser.add_argument("--output", required=True, type=Path, help="bundle file (.tar.gz)")
    parser.set_defaults(func=cmd_bundle)


def cmd_bundle(args: argparse.Namespace) -> int:
    """`detinf bundle`."""
    from deterministic_inference.workflow.bundle import write_bundle
    from deterministic_inference.workflow.canonical import digest_bytes

    path = write_bundle(args.run_dir, args.output)
    print(f"wrote {path} ({digest_bytes(path.read_bytes())})")
    return 0


def _inspect(subparsers: Any) -> None:
    parser = subparsers.add_parser("inspect", help="summarise a manifest, lock, run dir or bundle")
    parser.add_argument("--input", required=True, type=Path,
                        help="a manifest, lock, run dir, bundle.json, .tar.gz bundle or verify report")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    """`detinf inspect`."""
    from deterministic_inference.workflow.inspect import inspect_path, summary_lines

    summary = inspect_path(args.input)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True, ensure_ascii=False))
    else:
        print("\n".join(summary_lines(summary)))
    return 0


def _warn(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
