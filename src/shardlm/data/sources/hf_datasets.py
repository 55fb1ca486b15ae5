"""Hugging Face `datasets` folders (`Dataset.save_to_disk`): one source, read as its .arrow files in
state.json's order (with pyarrow only: `datasets` itself is not needed). A DatasetDict folder (splits) is a
clear error naming a split's folder."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.data.sources.base import Reader
from shardlm.errors import ConfigError


class HFDatasetReader(Reader):
    """A `Dataset.save_to_disk` folder: state.json and dataset_info.json; its files are read as .arrow."""

    name = "hf_datasets"
    folder_words = "a `datasets` save_to_disk folder"

    def is_folder(self, d: Path) -> bool:
        return (d / "state.json").is_file() and (d / "dataset_info.json").is_file()

    def check_folder(self, d: Path) -> None:
        if not (d / "dataset_dict.json").is_file():
            return
        try:
            splits = json.loads((d / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in d.iterdir() if p.is_dir() and self.is_folder(p))
        raise ConfigError(f"{d} is a `datasets` DatasetDict (splits: {', '.join(map(str, splits))}); "
                          f"set data.path to one split's folder, e.g. {d / str(splits[0] if splits else 'train')}")

    def files(self, spec: str) -> list[Path]:
        """The folder's .arrow files in state.json's `_data_files` order."""
        d = Path(spec)
        try:
            state = json.loads((d / "state.json").read_text(encoding="utf-8"))
            names = [entry["filename"] for entry in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{d / 'state.json'}: no `_data_files` list ({type(e).__name__}: {e}); "
                              f"save the dataset again with Dataset.save_to_disk") from None
        files = [d / n for n in names]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{d / 'state.json'} lists {f.name}, which is missing; save the dataset again")
        return files
