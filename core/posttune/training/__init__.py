"""Training: compose the session, run the loop, save the result (docs/architecture.md).

    claim the output directory -> compose(plan) -> config.yaml, banner -> start trackers
    -> samples before -> train(session) -> save final -> samples after -> summary (and
    summary.json) -> finish trackers -> Method.close (on every exit, from the method's setup on)

Exit statuses (docs/training.md): 0 done; 2 a user error, a write failure or a NaN/Inf the
run may not skip (one line on stderr); 75 a failure worth retrying; 143 preempted by SIGTERM after
saving a checkpoint. ``run.json`` records how the run ended (``status``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

#: torchrun runs this module on every rank: it re-enters `posttune train` there.
WORKER_MODULE = "posttune.training.worker"


def run(plan: Any) -> int:
    from posttune.cli.launch import leave_to_launcher
    from posttune.errors import one_line
    from posttune.training import distributed, output_dir, preemption, run_report
    from posttune.training.compose import close_method, compose

    # Rank 0 (known from torchrun's environment: no process group yet) holds the directory.
    main = int(os.environ.get("RANK", "0")) == 0
    with output_dir.claimed(plan.config, main=main):
        if main:
            print(run_report.preparing(plan), flush=True)
        out, show, session = Path(plan.config.checkpoint.output_dir), main, None
        try:
            with preemption.stopping_setup():
                session = compose(plan)  # closes the method itself if it fails after the method's setup
            show = distributed.is_main()
            return _run(session, show, out)
        except preemption.StoppedInSetup as stopped:
            if show:
                output_dir.record_status(out, "preempted", checkpoint=None)
            # torchrun stops the healthy ranks with this same SIGTERM when one rank fails: under posttune's launcher
            # that rank's error is the job's one line, and this note is printed only for a job that was stopped
            leave_to_launcher(stopped, f"posttune: {stopped}", show)
            return preemption.PREEMPTED
        except KeyboardInterrupt:  # run.json says how the run ended, for whoever watches the folder
            if show:
                output_dir.record_status(out, "interrupted", **({"step": session.step} if session else {}))
            raise
        except BaseException as exc:  # composing too: a checkpoint that fails to load
            if show:
                output_dir.record_status(out, "failed", **({"step": session.step} if session else {}),
                                         error=one_line(str(exc)))
            raise
        finally:  # success, an error, Ctrl-C, preemption: what the method opened is closed
            if session is not None:
                close_method(session)


def _run(session: Any, show: bool, out: Path) -> int:
    """The composed run: samples, training, the final save, the report; its status in run.json as it ends."""
    from posttune import tracking
    from posttune.training import distributed, output_dir, preemption
    from posttune.training.trainer import train

    if show:
        start(session)
    # Trackers run on the main rank only; one that fails to start stops the run here, in one line.
    trackers = start_trackers(session) if show else tracking.Trackers()
    with tracking.running(trackers):  # leaving early (preempted, an error) finishes them as stopped
        before = sample(session)
        try:
            summary = train(session)
        except preemption.Preempted as stopped:
            if show:
                print(f"posttune: {stopped}", file=sys.stderr)
                output_dir.record_status(out, "preempted", step=stopped.step, checkpoint=str(stopped.checkpoint))
            return preemption.PREEMPTED
        except KeyboardInterrupt:
            if show:  # Ctrl-C saves nothing: say what is kept and how to stop with a checkpoint
                print(f"posttune: {interrupted(session)}", file=sys.stderr)
            raise
        with preemption.watching():  # a SIGTERM now lets the save finish: the run is then complete
            outputs = save_final(session)
            stopping = preemption.asked()
        if stopping and show:
            print("posttune: SIGTERM during the final save: it finished, and the run is complete", file=sys.stderr)
        after = [] if stopping else sample(session)
        if show:
            outputs = report(session, summary, outputs, before, after)
            trackers.finish(summary, artefacts(session, outputs))
            output_dir.record_status(out, "finished", step=session.step)
    distributed.shutdown()
    return 0


def interrupted(session: Any) -> str:
    """What a Ctrl-C in training leaves: the newest checkpoint of the run to resume from, or none."""
    from posttune.training.output_dir import checkpoints
    from posttune.training.state import checkpoint_root

    saved = checkpoints(checkpoint_root(session))
    kept = (f"the newest checkpoint is {saved[-1]} (resume with checkpoint.resume=latest)" if saved
            else "and the run has no checkpoint yet (checkpoint.save_every sets how often one is written)")
    return (f"Ctrl-C at step {session.step} saves nothing{':' if saved else ','} {kept}; SIGTERM (kill PID) stops "
            "after the current step with a checkpoint")


def start(session: Any) -> None:
    """Main rank, before the progress bar: save the resolved config (naming what a resume changed)
    and print the banner, so the user sees what trains before the first step."""
    from posttune.training import run_report as report

    changed = report.save_config(session.plan, Path(session.config.checkpoint.output_dir),
                                 resumed=session.resume_from)
    for line in report.banner(session) + ([changed] if changed else []):
        print(line)
    sys.stdout.flush()


def start_trackers(session: Any) -> Any:
    """Start the run's experiment trackers (`logging:`), told the resolved config (as config.yaml
    holds it), the output directory, and the lineage and step a resume continues."""
    from posttune import tracking
    from posttune.descriptors import TrackerRun
    from posttune.training.run_report import resolved_config

    out = Path(session.config.checkpoint.output_dir)
    run = TrackerRun(name=out.resolve().name, output_dir=out, config=resolved_config(session.plan), options=None,
                     run_id=session.run_id, resumed_step=session.step if session.resume_from is not None else None,
                     total_steps=session.total_steps)
    return tracking.start(session.plan.logging, session.plan.logging_options, run)


def artefacts(session: Any, outputs: dict[str, str]) -> dict[str, Path]:
    """The files a finished run wrote, by name, for the trackers: the outputs that exist, and config.yaml."""
    from posttune.training.run_report import CONFIG_FILE

    found = {key: Path(value) for key, value in outputs.items() if value and Path(value).exists()}
    config = Path(session.config.checkpoint.output_dir) / CONFIG_FILE
    return {**found, "config": config} if config.is_file() else found


def sample(session: Any) -> list[tuple[str, str]]:
    """Greedy completions of ``train.sample_prompts``, rendered with the chat template, in one batch (by the
    engine ``first_party.ENGINE``)."""
    from posttune.engines import complete
    from posttune.generation import Sampling

    prompts = session.config.train.sample_prompts
    if not prompts:
        return []
    tokenizer, model = session.tokenizer, session.model
    was_training = model.training
    model.eval()
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
           if tokenizer.chat_template else tokenizer.encode(prompt) for prompt in prompts]
    sampling = Sampling(session.config.train.sample_max_new_tokens, stop_token_ids=tokenizer.eos_ids,
                        pad_id=tokenizer.pad_id or 0)
    out = complete(model, ids, sampling, where="train.sample_prompts")
    model.train(was_training)
    return [(prompt, tokenizer.decode(tokens, skip_special_tokens=True))
            for prompt, tokens in zip(prompts, out.token_lists(), strict=True)]


def save_final(session: Any) -> dict[str, str]:
    """The trained model (or adapter, and the merged model if asked), each trained role's beside it
    (``<role>/``, or ``<role>-adapter/``), and the loss plot."""
    from posttune.training import distributed, nonfinite
    from posttune.training.state import trained_models

    out = Path(session.config.checkpoint.output_dir)
    name = "adapter" if session.config.adapter is not None else "model"
    nonfinite.check_weights(session, f"the final {name} {out / name}")  # a good model there stays
    # Techniques that trained a stand-in for the exported model put the real one back first
    # (QLoRA dequantises its NF4 base, QAT swaps in its quantised weights).
    for prepare in session.before_final_save:
        prepare(session)
    outputs: dict[str, str] = {}
    for role, model in trained_models(session).items():
        model_name = "model" if role == "policy" else role
        outputs.update(_save_trained(session, model, out, model_name, "adapter" if role == "policy" else
                                     f"{role}-adapter"))
    if distributed.is_main():
        outputs["metrics"] = str(out / "metrics.jsonl")
        try:
            from posttune.training.plot import plot_losses

            return_free_heap()
            outputs["plot"] = str(plot_losses(out, panels=session.plan.method.descriptor.plot))
        except Exception as exc:  # noqa: BLE001 - the plot is a convenience; training succeeded
            outputs["plot"] = f"(not written: {exc})"
    return outputs


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Called before the end-of-run plot: matplotlib's import takes ~35 MiB, which otherwise lands on
    top of the pages training freed but glibc kept, and becomes the run's peak resident memory
    on small models (docs/memory.md, "The bundled CPU examples")."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _save_trained(session: Any, model: Any, out: Path, model_name: str, adapter_name: str) -> dict[str, str]:
    """One trained model's export: ``out/model_name`` (full), or ``out/adapter_name`` and, with
    ``save_merged``, the merged model in ``out/model_name``; every rank calls it (a sharded model is gathered)."""
    from posttune.checkpoint.score_head import PolicyHead
    from posttune.training import distributed
    from posttune.training.state import save_model_or_adapter
    from posttune.training.write_errors import writing

    adapted = session.config.adapter is not None and not isinstance(model, PolicyHead)  # a head has no adapters
    name = adapter_name if adapted else model_name
    with writing(out / name, "model"):
        saved = save_model_or_adapter(session, out / name, model)
    outputs = {name: str(saved) if distributed.is_main() else ""}
    if adapted and session.config.checkpoint.save_merged and distributed.is_main():
        from posttune.adapters import merge_adapters
        from posttune.checkpoint.hf_save import save_hf

        merge_adapters(model)  # training is over: fold the adapters in, in place
        with writing(out / model_name, "model"):
            outputs[model_name] = str(save_hf(model, out / model_name, tokenizer=session.tokenizer))
    return outputs


def report(session: Any, summary: dict[str, Any], outputs: dict[str, str], before: list,
           after: list) -> dict[str, str]:
    """The summary as aligned lines (the same values go to OUTPUT/summary.json, with the data's skipped and
    truncated counts where there are any), then the outputs; returns the outputs with summary.json among them."""
    from posttune.training.run_report import save_summary, summary_lines

    skipped = getattr(session.train_data, "skipped", None)
    counts = {"skipped_bad_rows": getattr(skipped, "bad_rows", 0),
              "skipped_untrained": getattr(skipped, "untrained", 0),
              "truncated_samples": getattr(skipped, "truncated", 0),
              "split_samples": getattr(skipped, "split", 0),
              "empty_responses": getattr(skipped, "empty", 0)}
    summary.update({key: value for key, value in counts.items() if value})  # for summary.json and the trackers
    if getattr(skipped, "first_bad", ""):  # which row, and why: what the error would have said without the skip
        summary["first_skipped_row"] = skipped.first_bad
    outputs = {**outputs, "summary": str(save_summary(Path(session.config.checkpoint.output_dir), summary))}
    print("\n== summary ==")
    print("\n".join(summary_lines(summary)))
    if skipped is not None and skipped.total:
        first = f" (the first: {skipped.first_bad})" if getattr(skipped, "first_bad", "") else ""
        print(f"data: skipped {skipped.bad_rows} bad row(s){first} and {skipped.untrained} sample(s) with no token "
              "to train on (no response to learn, blank text, or all of it past data.max_seq_len)")
    if skipped is not None and getattr(skipped, "truncated", 0):
        print(f"data: {skipped.truncated} sample(s) cut to data.max_seq_len ({session.config.data.max_seq_len}): "
              "their ends did not train")
    if skipped is not None and getattr(skipped, "empty", 0):
        print(f"data: {skipped.empty} sample(s) with an empty or blank response trained little more than the end "
              "token (they teach the model to answer with nothing): drop or fill those rows")
    for key, value in outputs.items():
        print(f"{key}: {value}")
    for (prompt, old), (_, new) in zip(before, after, strict=True):
        print(f"\nprompt: {prompt}\n  before: {old!r}\n  after:  {new!r}")
    return outputs
