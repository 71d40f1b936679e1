"""Tables of what a program's calls cost and what the prefix cache served."""

from __future__ import annotations

from radixkv.frontend.program import CallRecord


def calls_table(calls: list[CallRecord], labels: list[str] | None = None) -> str:
    """One row per call: prompt tokens, how many came from the cache, new tokens,
    generated tokens and seconds; then the totals."""
    labels = labels or [f"{c.kind} {c.name or ''}".strip() for c in calls]
    width = max([len(label) for label in labels] + [4])
    head = f"{'call':<{width}}  {'prompt':>7}  {'cached':>7}  {'hit %':>6}  {'out':>5}  {'seconds':>8}"
    rows = [head, "-" * len(head)]
    for label, c in zip(labels, calls):
        hit = 100 * c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        rows.append(f"{label:<{width}}  {c.prompt_tokens:>7}  {c.cached_tokens:>7}  {hit:>6.1f}  "
                    f"{c.completion_tokens:>5}  {c.seconds:>8.2f}")  # fmt: skip
    prompt = sum(c.prompt_tokens for c in calls)
    cached = sum(c.cached_tokens for c in calls)
    rows.append("-" * len(head))
    rows.append(f"{'total':<{width}}  {prompt:>7}  {cached:>7}  {100 * cached / max(prompt, 1):>6.1f}  "
                f"{sum(c.completion_tokens for c in calls):>5}  {sum(c.seconds for c in calls):>8.2f}")  # fmt: skip
    return "\n".join(rows)
