"""One-line mutation testing: does the test suite notice small bugs in the engine and server?

Each :class:`Mutant` replaces one exact source line fragment (it must occur exactly once in
its file) with a plausible bug. For each mutant the script copies the repository to a
temporary directory, applies the mutant there (the working tree is never touched), runs the
mutant's test files with ``pytest -x`` and records *killed* (a test failed) or *survived*
(every selected test passed). The kill rate is printed as a table at the end.

Selecting test files per mutant keeps a full run affordable on a small machine; ``--full``
runs the whole suite for each mutant instead (slow, the most honest number).

    python scripts/mutate.py                 # every mutant, its own test files
    python scripts/mutate.py --list          # the mutants, nothing run
    python scripts/mutate.py --only topp_boundary credit_plus_one   # in this order
    python scripts/mutate.py --full --only abort_lost

Exit status: 0 when every mutant run was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # exact fragment; must occur exactly once
    new: str
    tests: tuple[str, ...]  # test files (or node ids) that should kill it
    why: str = ""


P = "pagefold/"
SRV = "tests/test_server_hardening.py"
MUT = "tests/test_mutant_killers.py"
CAP = "tests/test_capacity_reality.py"
DP = "tests/test_dp_routing_property.py"
EDGE = "tests/test_length_edges.py"
RES = "tests/test_scheduler_resume.py"
CON = "tests/test_cache_contents.py"
ACC = "tests/test_pool_accounting.py"
# The scheduler's fake-model tests (no model runs: seconds in all).
SCH = ("tests/test_scheduler.py", RES, CON, ACC, "tests/test_fork_cow.py",
       "tests/test_step_contract.py", CAP)
CAPT = "tests/test_capacity.py"
REJ = "tests/spec_decode/test_rejection.py"
NG = "tests/spec_decode/test_config_ngram.py"
AK = "tests/spec_decode/test_adaptive_k.py"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- issue 16's survivors
    Mutant("ckpt_restore_short", P + "core/managers.py",
           "key = self._key(hashes[num_computed // bs - 1])",
           "key = self._key(hashes[min(num_computed // bs, len(hashes) - 1)])",
           (MUT,), "a checkpoint filed one block late: restored, the state is a block short"),
    Mutant("min_p_wrong_rows", P + "executor/sampler.py",
           "thresh = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)",
           "thresh = probs.amax(dim=1, keepdim=True) * min_p.roll(1).unsqueeze(1)",
           (MUT,), "min_p applied to the neighbouring row"),
    Mutant("topp_boundary", P + "executor/sampler.py",
           "drop_sorted = (mass_before >= top_p.unsqueeze(1))",
           "drop_sorted = (mass_before > top_p.unsqueeze(1))", (MUT,), "top-p at the threshold"),
    Mutant("credit_plus_one", P + "core/kv_cache_manager.py",
           "return self._find_hit(req, plan=False) * self.block_size",
           "return (self._find_hit(req, plan=False) + 1) * self.block_size",
           (MUT,), "recompute credit inflated by one block"),
    Mutant("cached_tokens_last", P + "entrypoints/openai/serving_completion.py",
           "n_cached += out.num_cached_tokens", "n_cached = out.num_cached_tokens",
           (SRV + "::test_multi_prompt_usage_sums",), "multi-prompt cached_tokens = last"),
    Mutant("stream_usage_last", P + "entrypoints/openai/serving_completion.py",
           "sum(o.num_cached_tokens for o in outs)", "outs[-1].num_cached_tokens",
           (SRV + "::test_multi_prompt_usage_sums",), "streamed cached_tokens = last"),
    Mutant("abort_lost", P + "engine/client.py",
           "self._send(AbortRequests([request_id]))", "pass",
           (SRV + "::test_disconnect_reaches_the_core",), "a disconnect never aborts the core"),
    # ---------------------------------------------------------------- issue 16's features
    Mutant("route_open", P + "entrypoints/openai/middleware.py",
           'OPEN_PATHS = ("/health",)', 'OPEN_PATHS = ("/health", "/tokenize")',
           (SRV + "::test_every_route_needs_the_key",), "/tokenize without the key"),
    Mutant("metrics_key_ignored", P + "entrypoints/openai/middleware.py",
           'self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS + ("/metrics",)',
           'self.open_paths = OPEN_PATHS + ("/metrics",)',
           (SRV + "::test_health_open_metrics_behind_key",),
           "--metrics-require-key ignored"),
    Mutant("body_count_reset", P + "entrypoints/openai/middleware.py",
           'seen += len(message.get("body", b""))', 'seen = len(message.get("body", b""))',
           (SRV + "::test_body_limit_413_before_parsing",), "chunked bodies never add up"),
    Mutant("tokenize_on_loop", P + "entrypoints/openai/tokenizing.py",
           "return await self.run(self.encode_sync, text, add_special_tokens)",
           "return self.encode_sync(text, add_special_tokens)",
           (SRV + "::test_health_answers_while_a_huge_tokenize_runs",),
           "tokenizing blocks the event loop"),
    Mutant("no_cheap_bound", P + "entrypoints/openai/tokenizing.py",
           "return num_chars > max_tokens * self.max_token_chars", "return False",
           (SRV + "::test_prompt_that_cannot_fit_refused_before_tokenizing",),
           "huge prompts tokenized before refusal"),
    Mutant("nan_allowed", P + "entrypoints/openai/validation.py",
           "if not math.isfinite(value):", "if False:",
           (SRV + "::test_nan_infinity_and_huge_integers_are_400",), "NaN in free-form fields"),
    Mutant("bigint_allowed", P + "entrypoints/openai/validation.py",
           "if not INT64_MIN <= value <= INT64_MAX:", "if False:",
           (SRV + "::test_nan_infinity_and_huge_integers_are_400",), "2**64 reaches msgspec"),
    Mutant("seed_unbounded", P + "sampling_params.py",
           "if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:",
           "if False:", ("tests/test_sampling_params.py",), "seed past 64 bits"),
    Mutant("temp_nan", P + "sampling_params.py",
           "if not math.isfinite(value):", "if False:", ("tests/test_sampling_params.py",),
           "NaN temperature offline"),
    Mutant("max_logprobs_off_by_one", P + "entrypoints/openai/serving_completion.py",
           "if logprobs is not None and logprobs > limit:",
           "if logprobs is not None and logprobs > limit + 1:",
           (SRV + "::test_max_logprobs_and_output_cap",), "--max-logprobs + 1 accepted"),
    Mutant("output_cap_ignores_logprobs", P + "entrypoints/openai/serving_completion.py",
           "per_token = samples * (1 + (logprobs or 0))", "per_token = samples",
           (SRV + "::test_max_logprobs_and_output_cap",), "logprob entries not counted"),
    Mutant("core_max_logprobs", P + "engine/core.py",
           "if value is not None and value > self.config.max_logprobs:",
           "if value is not None and value > self.config.max_logprobs + 5:",
           ("tests/test_engine_hardening.py::test_engine_max_logprobs",),
           "engine ignores max_logprobs"),
    Mutant("no_trim", P + "entrypoints/openai/memory.py", "self._trim(0)", "pass",
           (SRV + "::test_trimmer_gives_freed_memory_back",), "freed memory kept"),
    Mutant("long_len_accepted", P + "core/model_len.py",
           "if limit is not None and requested > limit:",
           "if limit is not None and requested > 2 * limit:",
           ("tests/test_engine_hardening.py",), "max_model_len past the positions"),
    Mutant("yarn_original_ignored", P + "core/model_len.py",
           'max_pos = rope.get("original_max_position_embeddings") or max_pos', "pass",
           ("tests/test_engine_hardening.py",), "yarn range from the wrong base"),
    Mutant("drain_not_refusing", P + "entrypoints/openai/shutdown.py",
           "self.inflight.draining = True", "self.inflight.draining = False",
           ("tests/test_server_shutdown.py",), "new requests accepted while draining"),
    Mutant("drain_no_wait", P + "entrypoints/openai/shutdown.py",
           "while self.inflight.active > 0 and time.monotonic() - start < self.timeout:",
           "while False:", ("tests/test_server_shutdown.py",), "in-flight not given time"),
    Mutant("ctrl_c_leaks", P + "llm.py", "        except BaseException:\n            "
           "self.abort(list(pending))", "        except Exception:\n            "
           "self.abort(list(pending))", ("tests/test_engine_hardening.py",),
           "Ctrl-C leaves requests holding blocks"),
    Mutant("config_error_unnamed", P + "checkpoint.py",
           'raise ValueError(f"{cfg} is not valid JSON', 'raise ValueError(f"not valid JSON',
           ("tests/test_engine_hardening.py",), "corrupt config.json not named"),
    Mutant("preempt_log_info", P + "core/kv_cache_manager.py",
           'logger.debug("preempting %s by %s', 'logger.info("preempting %s by %s',
           ("tests/test_engine_hardening.py",), "an INFO line per preemption"),
    Mutant("abort_prompt_uncounted", P + "engine/client.py",
           "t.num_prompt_tokens if t.num_tokens == 0 else 0)", "0)",
           ("tests/test_engine_hardening.py",), "aborted prompts not counted"),
    Mutant("aborts_uncounted", P + "core/scheduler.py", "self.num_aborted += 1", "pass",
           (SRV + "::test_disconnect_reaches_the_core",), "core abort counter"),
    Mutant("salt_dropped", P + "engine/core.py",
           'kw["extra_keys"] = ("cache_salt", cache_salt)', 'kw["extra_keys"] = ()',
           ("tests/test_engine_hardening.py",), "cache_salt ignored"),
    Mutant("salt_not_sent", P + "entrypoints/openai/serving_completion.py",
           "cache_salt=cache_salt)\n", "cache_salt=None)\n",
           (SRV + "::test_cache_salt_over_http",), "HTTP cache_salt ignored"),
    # ---------------------------------------------------------------- engine core / executor
    Mutant("max_tokens_off_by_one", P + "core/scheduler.py",
           "if sp.max_tokens is not None and r.num_output_tokens >= sp.max_tokens:",
           "if sp.max_tokens is not None and r.num_output_tokens > sp.max_tokens:",
           ("tests/test_engine_dense.py",), "one token too many"),
    Mutant("min_tokens_ignored", P + "core/scheduler.py",
           "if r.num_output_tokens >= sp.min_tokens:", "if True:",
           ("tests/test_scheduler.py", "tests/test_engine_dense.py", "tests/test_sampler.py"),
           "EOS before min_tokens"),
    Mutant("victim_head", P + "core/scheduler.py", "            return pool[-1]\n",
           "            return pool[0]\n", ("tests/test_scheduler.py",
                                        "tests/test_forks_preemption.py"),
           "FCFS preempts the oldest request"),
    Mutant("hash_skips_token", P + "core/prefix_cache.py",
           'h.update(array("q", tokens).tobytes())', 'h.update(array("q", tokens[1:]).tobytes())',
           ("tests/test_prefix_cache.py",), "blocks differing in their first token collide"),
    Mutant("hit_reaches_last_token", P + "core/kv_cache_manager.py",
           "max_blocks = (req.num_tokens - 1) // bs", "max_blocks = req.num_tokens // bs",
           ("tests/test_prefix_cache.py",), "a full-prompt hit leaves nothing to compute"),
    Mutant("topp_one_truncates", P + "executor/sampler.py",
           "drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)",
           "drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p <= 1.0).unsqueeze(1)",
           ("tests/test_sampler.py", MUT), "top_p = 1 rows truncated by rounding"),
    Mutant("stop_id_ignored", P + "core/scheduler.py",
           "if sp.stop_token_ids and token in sp.stop_token_ids:",
           "if sp.stop_token_ids and token in sp.stop_token_ids[1:]:",
           ("tests/test_scheduler.py", "tests/test_engine_dense.py"), "first stop id ignored"),
    Mutant("abort_family_child_only", P + "engine/core.py",
           "family = [rid] + [c for c, r in reqs.items() if r.parent_id == rid]",
           "family = [rid]", ("tests/test_forks_preemption.py", "tests/test_server_n.py"),
           "aborting a family leaves its children running"),
    # ---------------------------------------------------------------- server plumbing
    Mutant("choices_unsorted", P + "entrypoints/openai/serving_completion.py",
           'choices.sort(key=lambda c: c["index"])', "pass", ("tests/test_server_n.py",),
           "n > 1 choices out of order"),
    Mutant("no_done_after_error", P + "entrypoints/openai/serving_completion.py",
           "            yield self.stream_error_event(e)\n            yield SSE_DONE\n",
           "            yield self.stream_error_event(e)\n",
           ("tests/test_server_shutdown.py",), "a failed stream ends without [DONE]"),
    # ---------------------------------------------------------------- written after the suite
    # Independent of the tests above: each was written from the code, then run once.
    Mutant("hash_forgets_prefix", P + "core/prefix_cache.py",
           "parent = hash_block(parent, toks[i * block_size : (i + 1) * block_size])",
           "parent = hash_block(ROOT, toks[i * block_size : (i + 1) * block_size])",
           ("tests/test_prefix_cache.py", "tests/test_hybrid_cache.py"),
           "a block's hash names only its own tokens: equal blocks after different prefixes hit"),
    # ("last_block_unhashed", `<=` -> `<` in update_block_hashes, was dropped: equivalent. A
    # block that exactly ends a request's tokens is never usable as a hit (hits stop a token
    # short of the prompt) and is hashed one token later, when the next token arrives.)
    Mutant("fork_shares_hash_list", P + "core/kv_cache_manager.py",
           "child.block_hashes = list(parent.block_hashes)",
           "child.block_hashes = parent.block_hashes",
           ("tests/test_forks_preemption.py",),
           "forked children append their hashes to the parent's list"),
    Mutant("hit_one_block_short", P + "core/kv_cache_manager.py",
           "req.num_computed_tokens = hit_blocks * self.block_size",
           "req.num_computed_tokens = max(hit_blocks - 1, 0) * self.block_size",
           ("tests/test_prefix_cache.py", "tests/test_hybrid_cache.py"),
           "a hit resumes one block before the cached state"),
    Mutant("spec_chunk_past_boundary", P + "core/kv_cache_manager.py",
           "return min(num_new, boundary - start)", "return min(num_new, boundary - start + 1)",
           ("tests/spec_decode/test_engine_spec.py",),
           "a verify chunk crosses the block boundary its checkpoint needs"),
    Mutant("repetition_inverted", P + "executor/sampler.py",
           "scaled = torch.where(logits > 0, logits / rep, logits * rep)",
           "scaled = torch.where(logits > 0, logits * rep, logits / rep)",
           ("tests/test_sampler.py",), "repetition penalty rewards repeats"),
    Mutant("frequency_as_presence", P + "executor/sampler.py",
           "logits = logits - meta.frequency_penalties.to(device).unsqueeze(1) * counts",
           "logits = logits - meta.frequency_penalties.to(device).unsqueeze(1) * out_seen",
           ("tests/test_sampler.py",), "frequency penalty ignores the counts"),
    Mutant("rank_counts_ties", P + "executor/sampler.py",
           "ranks = (logprobs > chosen).sum(dim=1) + 1",
           "ranks = (logprobs >= chosen).sum(dim=1) + 1",
           ("tests/test_sampler.py", "tests/test_engine_dense.py"), "logprob rank one too high"),
    Mutant("logprobs_processed", P + "executor/sampler.py",
           "raw_logprobs = torch.log_softmax(raw.float(), dim=1)",
           "raw_logprobs = torch.log_softmax(logits, dim=1)",
           ("tests/test_sampler.py", "tests/test_engine_dense.py"),
           "logprobs from the penalised logits, not the model's"),
    Mutant("topk_drops_kth", P + "executor/sampler.py",
           "return logits.masked_fill_(logits < thresh, float(\"-inf\"))",
           "return logits.masked_fill_(logits <= thresh, float(\"-inf\"))",
           ("tests/test_sampler.py",), "top-k keeps k - 1 tokens"),
    Mutant("topp_drops_crossing", P + "executor/sampler.py",
           "mass_before = probs.cumsum(dim=1) - probs", "mass_before = probs.cumsum(dim=1)",
           ("tests/test_sampler.py",), "top-p drops the token whose mass reaches p"),
    Mutant("seed_ignored", P + "executor/sampler.py",
           "q[row].exponential_(generator=g)", "q[row].exponential_()",
           ("tests/test_sampler.py", "tests/test_engine_dense.py"), "per-request seeds ignored"),
    Mutant("budget_plus_one", P + "core/scheduler.py",
           "            n = min(n, budget)\n", "            n = min(n, budget + 1)\n",
           ("tests/test_scheduler.py", "tests/test_step_contract.py"),
           "a step schedules one token over max_num_batched_tokens"),
    Mutant("model_len_plus_one", P + "core/scheduler.py",
           "if r.num_tokens >= self.max_model_len:", "if r.num_tokens > self.max_model_len:",
           ("tests/test_scheduler.py", "tests/test_engine_dense.py", "tests/test_bad_input.py"),
           "a sequence grows one token past max_model_len"),
    Mutant("stop_across_deltas", P + "engine/detokenizer.py",
           "start = max(0, old_len - len(s) + 1)", "start = max(0, old_len)",
           ("tests/test_detokenizer.py",), "a stop string split across two tokens is missed"),
    Mutant("stop_later_match", P + "engine/detokenizer.py",
           "if idx != -1 and (best is None or idx < best[0]):",
           "if idx != -1 and (best is None or idx > best[0]):",
           ("tests/test_detokenizer.py",), "of two stop strings, the later one wins"),
    Mutant("stream_leaks_stop_prefix", P + "engine/detokenizer.py",
           "for n in range(min(len(s) - 1, len(text)), held, -1):",
           "for n in range(min(len(s) - 2, len(text)), held, -1):",
           ("tests/test_detokenizer.py",), "streaming sends the start of a stop string"),
    # ---------------------------------------------------------------- issue 44: capacity
    # Planted to check tests/test_capacity_reality.py: each moves the planner's (or the
    # allocator's) arithmetic by one block; the reality tests compare the two.
    Mutant("window_span_plus", P + "core/kv_cache_planner.py",
           "return min(full, cdiv(window + chunk - 2, block_size) + 1)",
           "return min(full, cdiv(window + chunk - 1, block_size) + 1)",
           (CAP,), "a window's span one token long: one block too many when aligned"),
    Mutant("window_span_minus", P + "core/kv_cache_planner.py",
           "return min(full, cdiv(window + chunk - 2, block_size) + 1)",
           "return min(full, cdiv(window + chunk - 2, block_size))",
           (CAP,), "a window one block short"),
    Mutant("window_floor", P + "core/kv_cache_planner.py",
           "return min(full, cdiv(window + chunk - 2, block_size) + 1)",
           "return min(full, (window + chunk - 2) // block_size + 1)",
           (CAP,), "floor for ceil: windows not a block multiple under-counted"),
    Mutant("window_ignores_chunk", P + "core/kv_cache_planner.py",
           "chunk = max(1, min(max_num_batched_tokens, num_tokens))", "chunk = 1",
           (CAP,), "the decode-only window figure (the bug issue 44 found)"),
    Mutant("ckpt_one_page", P + "core/kv_cache_planner.py",
           "return group.pages_per_state * (2 if enable_prefix_caching else 1)",
           "return group.pages_per_state + (1 if enable_prefix_caching else 0)",
           (CAP,), "the prefix-cache checkpoint counted as one page, not a state's worth"),
    Mutant("state_pages_plus", P + "core/kv_cache_planner.py",
           "pages_per_state=cdiv(spec.state_bytes, page) if isinstance(spec, StateSpec) else 0",
           "pages_per_state=cdiv(spec.state_bytes, page) + 1 if isinstance(spec, StateSpec) "
           "else 0",
           (CAP, "tests/test_capacity.py"), "a state a page longer (planner and allocator agree: "
           "the independent byte check in test_capacity.py must see it)"),
    Mutant("allocator_window_late", P + "core/managers.py",
           "first_needed = max(0, num_computed - window + 1)",
           "first_needed = max(0, num_computed - window)",
           (CAP,), "the allocator keeps one token more than the window: the report disagrees"),
    Mutant("draft_past_max_tokens", P + "spec_decode/engine.py",
           "room = min(room, mt - r.num_output_tokens - 1)",
           "room = min(room, mt - r.num_output_tokens)",
           (CAP,), "a draft slot past the request's end: one more block at a block boundary"),
    Mutant("cli_spec_state_rows", P + "entrypoints/capacity_cmd.py",
           'num_speculative_tokens=args.num_speculative_tokens if args.layout == "vllm" else 0,',
           "num_speculative_tokens=args.num_speculative_tokens,",
           (CAP,), "the pagefold report sizes states with vLLM's speculative conv rows"),

    # ---------------------------------------------------------------- issue 44: routing
    Mutant("route_waiting_double", P + "engine/dp_client.py",
           "return (self.in_flight + self.waiting, self.kv_usage)",
           "return (self.in_flight + 2 * self.waiting, self.kv_usage)",
           (DP,), "waiting requests weigh twice"),
    Mutant("route_kv_reversed", P + "engine/dp_client.py",
           "return (self.in_flight + self.waiting, self.kv_usage)",
           "return (self.in_flight + self.waiting, -self.kv_usage)",
           (DP,), "the fuller KV cache wins a tie"),
    Mutant("route_slack_strict", P + "engine/dp_client.py",
           "if busy <= floor + self.prefix_slack:", "if busy < floor + self.prefix_slack:",
           (DP,), "the prefix loses exactly at the slack"),
    Mutant("route_owner_ignores_waiting", P + "engine/dp_client.py",
           "busy = loads[owner].in_flight + loads[owner].waiting",
           "busy = loads[owner].in_flight", (DP,), "the owner's queue not counted"),
    Mutant("route_tie_last", P + "engine/dp_client.py",
           "least = min(range(self.n), key=lambda i: (loads[i].key, i))",
           "least = min(range(self.n), key=lambda i: (loads[i].key, -i))",
           (DP,), "full ties go to the last replica"),
    Mutant("route_prefix_whole_prompt", P + "engine/dp_client.py",
           "while blocks * self.block_size <= len(prompt) - 1:",
           "while blocks * self.block_size <= len(prompt):",
           (DP,), "a prefix that leaves no token after it"),
    Mutant("route_shortest_prefix", P + "engine/dp_client.py",
           "for k in reversed(keys):", "for k in keys:",
           (DP,), "the shortest known prefix decides, not the longest"),

    # ---------------------------------------------------------------- issue 44: edges, resume
    Mutant("edge_prompt_at_limit", P + "entrypoints/openai/serving_completion.py",
           "if len(ids) >= self.max_model_len:", "if len(ids) > self.max_model_len:",
           (EDGE,), "a prompt of max_model_len tokens passes the server's first check"),
    Mutant("edge_room_by_one", P + "entrypoints/openai/serving_completion.py",
           "if max_tokens is not None and max_tokens > room:",
           "if max_tokens is not None and max_tokens >= room:",
           (EDGE,), "max_tokens exactly at the room refused"),
    Mutant("edge_offline_at_limit", P + "engine/core.py",
           "if n >= self.max_model_len:", "if n > self.max_model_len:",
           (EDGE + "::test_offline_llm_edges",), "the offline engine takes a full-length prompt"),
    Mutant("resume_hit_covers_last", P + "core/kv_cache_manager.py",
           "max_blocks = (req.num_tokens - 1) // bs", "max_blocks = req.num_tokens // bs",
           (RES,), "a prefix hit may cover the last token (nothing left to compute)"),
    Mutant("resume_no_swap", P + "core/kv_cache_manager.py",
           'self.preemption_mode = mode if self.host is not None else "recompute"',
           'self.preemption_mode = "recompute"', (RES,), "swap mode silently recomputes"),
    Mutant("resume_swap_loses_progress", P + "core/kv_cache_manager.py",
           "        self.swapped[req.request_id] = SwappedRequest(host_lists, nbytes)\n",
           "        self.swapped[req.request_id] = SwappedRequest(host_lists, nbytes)\n"
           "        req.num_computed_tokens -= req.num_computed_tokens % self.block_size\n",
           (RES,), "a swapped request resumes at its last block boundary"),

    # ---------------------------------------------- issue 44, second round: where mutmut
    # was not run (the scheduler, the capacity report, speculative decoding) and the state
    # and fork handling the contents oracle (tests/test_cache_contents.py) now checks.
    Mutant("ckpt_key_next_block", P + "core/managers.py",
           "        key = self._key(hashes[num_tokens // bs - 1])\n",
           "        key = self._key(hashes[min(num_tokens // bs, len(hashes) - 1)])\n",
           (CON,), "an in-kernel capture filed under the next block's hash"),
    Mutant("restore_own_pages_late", P + "core/managers.py",
           "        return [PageCopy(self.index, [b.block_id for b in e.blocks], dst)]",
           "        return [PageCopy(self.index, dst, [b.block_id for b in e.blocks])]",
           (CON,), "a hit's restore copies the request's pages over the checkpoint"),
    Mutant("fork_state_shared", P + "core/managers.py",
           "        self.allocate(child_id, 0, 0)\n        return [PageCopy(",
           "        self.req_blocks[child_id] = list(self.req_blocks[parent_id])\n"
           "        self.pool.touch(self.req_blocks[child_id])\n        return [PageCopy(",
           (CON,), "a fork shares its parent's state pages instead of copying them"),
    Mutant("own_ckpt_not_held", P + "core/managers.py",
           "        self.pool.touch(dst)  # ... and held by the request as its newest checkpoint\n"
           "        self._keep_as_own(req_id, dst)\n",
           "",
           (ACC,), "a running request does not hold its newest checkpoint"),
    Mutant("window_frees_shared", P + "core/managers.py",
           "if b is not self.pool.null_block and b.ref_cnt == 1)",
           "if b is not self.pool.null_block)",
           (ACC, CON), "a dead window block shared with a fork counted as freed"),
    Mutant("swap_out_before_fork_copy", P + "core/kv_cache_manager.py",
           "                and not self._copies_into(req.request_id):",
           ":",
           (CON,), "a request swapped out in the step that queued a copy into its pages"),
    Mutant("sched_victim_budget_lost", P + "core/scheduler.py",
           "budget += scheduled.pop(victim.request_id)",
           "scheduled.pop(victim.request_id)",
           SCH, "a preempted, already scheduled request's tokens stay spent"),
    Mutant("sched_fork_one_fewer_shared", P + "core/scheduler.py",
           "for m in range(k, 0, -1) if self.kv.can_fork(parent, m)",
           "for m in range(k - 1, 0, -1) if self.kv.can_fork(parent, m)",
           SCH, "one child fewer than fits continues from the parent's cache"),
    Mutant("sched_spec_rejected_kept", P + "core/scheduler.py",
           "r.num_computed_tokens -= len(drafts) - tok.num_accepted",
           "r.num_computed_tokens -= len(drafts) - tok.num_accepted - 1",
           SCH, "one rejected draft counted as computed"),
    Mutant("sched_spec_stop_computed", P + "core/scheduler.py",
           "r.num_computed_tokens = r.num_tokens - 1",
           "r.num_computed_tokens = r.num_tokens",
           SCH, "a verify step that stops early counts its last token as computed"),
    Mutant("sched_replace_keeps_hash", P + "core/scheduler.py",
           "if len(r.block_hashes) * self.kv.block_size >= r.num_tokens:",
           "if len(r.block_hashes) * self.kv.block_size > r.num_tokens:",
           SCH, "a replaced token that completes a block keeps the old block's hash"),
    Mutant("cap_bpr_first_length", P + "core/capacity.py",
           "    bpr = per_request[max_model_len]\n",
           "    bpr = per_request[points[0]]\n",
           (CAPT, CAP), "the report's per-request blocks at its shortest length"),
    Mutant("cap_usable_counts_null", P + "core/capacity.py",
           "        usable = usable_blocks(cfg)\n",
           "        usable = cfg.num_blocks\n",
           (CAPT, CAP), "the null block counted as usable"),
    Mutant("cap_one_request_refused", P + "core/capacity.py",
           "    if usable < bpr:\n",
           "    if usable <= bpr:\n",
           (CAPT, CAP), "a pool that holds exactly one request refused"),
    Mutant("cap_state_blocks_any_group", P + "core/capacity.py",
           'state_blocks = sum(g["blocks_per_request"] for g in groups if g["pages_per_state"])',
           'state_blocks = sum(g["blocks_per_request"] for g in groups)',
           (CAPT, CAP), "attention pages counted as fixed state"),
    Mutant("sd_resid_keeps_draft", P + "spec_decode/rejection.py",
           "                    resid[d[a]] = 0.0\n",
           "                    resid[d[a]] *= 1.0\n",
           (REJ,), "the residual keeps the rejected n-gram draft"),
    Mutant("sd_ratio_ignores_q", P + "spec_decode/rejection.py",
           "ratio = p_d if qd is None else p_d / qd.gather(1, idx.unsqueeze(1)).squeeze(1)",
           "ratio = p_d",
           (REJ,), "a draft model's q left out of the acceptance ratio"),
    Mutant("sd_bonus_from_last_draft_row", P + "spec_decode/rejection.py",
           "                last = _race(probs[row + m], gen)\n",
           "                last = _race(probs[row + max(m - 1, 0)], gen)\n",
           (REJ,), "the bonus token drawn from the last draft's row"),
    Mutant("sd_greedy_first_row", P + "spec_decode/rejection.py",
           "while a < m and greedy_tok[row + a] == d[a]:",
           "while a < m and greedy_tok[row] == d[a]:",
           (REJ,), "every greedy draft compared with the first row's argmax"),
    Mutant("sd_ngram_oldest", P + "spec_decode/ngram.py",
           "end = int(cand[np.flatnonzero(match == best)[-1]])",
           "end = int(cand[np.flatnonzero(match == best)[0]])",
           (NG,), "the oldest occurrence of the suffix, not the most recent"),
    Mutant("sd_next_k_accepted", P + "spec_decode/engine.py",
           "        return max(1, accepted + 1)\n",
           "        return max(1, accepted)\n",
           (AK,), "adaptive k shrinks to the accepted count"),
    Mutant("sd_backoff_linear", P + "spec_decode/engine.py",
           "wait = min(1 << fails, self.MAX_BACKOFF)",
           "wait = min(1 + fails, self.MAX_BACKOFF)",
           (AK,), "a failing request's back-off grows linearly, not doubling"),
]


def copy_repo(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".ruff_cache",
                                    ".pytest_cache", "build", "dist")
    for item in ROOT.iterdir():
        if item.name in {".git", ".venv", "build", "dist"} or item.name.endswith(".egg-info"):
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name, ignore=ignore)
        elif item.is_file():
            shutil.copy2(item, dst / item.name)


def apply(root: Path, m: Mutant) -> None:
    f = root / m.path
    text = f.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutant {m.name}: the fragment occurs {count} times in {m.path} "
                         "(must be exactly once); update the mutant list")
    f.write_text(text.replace(m.old, m.new))


def run_one(m: Mutant, *, full: bool, timeout: float) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        apply(root, m)
        tests = ["tests"] if full else list(m.tests)
        env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "killed (timeout)", time.monotonic() - t0, ""
        took = time.monotonic() - t0
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # The short summary's "FAILED node" names the killing test; the traceback's "E" lines
        # say whether an assertion killed it (a crash proves only that the code ran).
        failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
        tail = failed[0] if failed else (lines[-1] if lines else "")
        if proc.returncode == 0:
            return "SURVIVED", took, tail
        asserted = any(ln.startswith("E ") and ("AssertionError" in ln or "DID NOT RAISE" in ln
                                                  or ln[1:].strip().startswith("assert "))
                       for ln in lines)
        if proc.returncode == 1 and not asserted:
            return "killed (crash)", took, tail
        if proc.returncode in (1, 3):  # tests failed / internal error
            return "killed", took, tail
        return f"killed (pytest exit {proc.returncode})", took, tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--full", action="store_true", help="run the whole suite per mutant")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    args = p.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = set(args.only or ()) - set(by_name)
    if unknown:
        raise SystemExit(f"unknown mutants: {sorted(unknown)}")
    chosen = [by_name[n] for n in args.only] if args.only else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name:30s} {m.path:45s} {m.why}")
        return 0
    for m in chosen:  # every fragment must still be found before anything runs
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            raise SystemExit(f"mutant {m.name}: fragment found {count} times in {m.path}")
    rows = []
    for m in chosen:
        status, took, tail = run_one(m, full=args.full, timeout=args.timeout)
        rows.append((m, status, took))
        print(f"{m.name:30s} {status:22s} {took:6.1f} s  {tail[:160]}", flush=True)
    killed = sum(1 for _, s, _ in rows if s.startswith("killed"))
    print("\n| mutant | file | status | seconds |\n|---|---|---|---|")
    for m, s, took in rows:
        print(f"| {m.name} | {m.path} | {s} | {took:.0f} |")
    print(f"\nkilled {killed} of {len(rows)} mutants ({100 * killed / max(len(rows), 1):.0f}%)")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
