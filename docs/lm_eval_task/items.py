"""flame_sample_mc's items, read through datasets' json builder from items.jsonl beside this file: a data_files path
in the YAML would be resolved against the working directory, not the task's folder."""

from pathlib import Path

import datasets


def load(**metadata) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("items.jsonl"))})
