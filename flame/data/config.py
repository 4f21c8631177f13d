"""The [data] section: where text comes from and how it becomes batches."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceConfig:
    path: str = ""
    """A glob of local files or a hub dataset id."""
    weight: float = 1.0
    """Relative sampling weight when several sources are mixed."""

    def validate(self, key: str) -> None:
        from flame.config import check

        check(bool(self.path), f"{key}.path", "a glob or a hub dataset id")
        check(self.weight > 0, f"{key}.weight", "a number > 0", self.weight)


@dataclass
class DataConfig:
    synthetic: bool = False
    """A deterministic synthetic token stream (no files, no tokenizer): for tests and benchmarks."""
    sources: list[SourceConfig] = field(default_factory=list)
    """[[data.sources]] tables."""
    eval_sources: list[SourceConfig] = field(default_factory=list)
    """[[data.eval_sources]] tables, for validation."""
    tokenizer: str = "data/tokenizer/gpt-neox-20b/tokenizer.json"
    """A tokenizer.json path or a hub id."""

    def validate(self) -> None:
        from flame.config import check

        if not self.synthetic:
            check(bool(self.sources), "data.sources", "at least one [[data.sources]] table (or data.synthetic = true)")
        for name in ("sources", "eval_sources"):
            for i, source in enumerate(getattr(self, name)):
                source.validate(f"data.{name}[{i}]")
