"""Chat SFT on logic puzzles (Latin square, Futoshiki, mini-Sudoku) with unique solutions and exact verifiers."""

from __future__ import annotations

from typing import Any, Literal

from lightning_llm.datamodules.chat_sft import ChatSFTDataModule

__all__ = ["PuzzleDataModule"]

#: Arguments of the base that this DataModule sets itself: the task is the puzzle family.
_FIXED = ("task", "task_kwargs", "source", "columns", "val_split")
_FAMILIES = ("latin_square", "futoshiki", "mini_sudoku")


class PuzzleDataModule(ChatSFTDataModule):
    """Chat SFT batches of logic puzzles: the prompt states the rules and the grid, the target is the solution.

    The puzzle generators of arXiv 2606.03883's setting (scalable, with exact verifiers): every puzzle has
    exactly one solution, the reference completion is ``<answer>1234/3412/2143/4321</answer>`` (rows joined by
    ``/``), and :attr:`task` ``.score`` is the verifier (also the reward for RL on the same task). Validation
    prompts never occur in training (:func:`~lightning_llm.datamodules.tasks.split_train_val`).

    This is :class:`~lightning_llm.datamodules.chat_sft.ChatSFTDataModule` with ``task=family`` and the
    puzzle parameters as ``task_kwargs``; for RL prompts use ``PromptDataModule`` with ``task: futoshiki`` etc.

    Args:
        family: The puzzle family: ``"latin_square"``, ``"futoshiki"`` or ``"mini_sudoku"``.
        size: The grid side ``n`` (values ``1..n``): 3 to 6 for Latin square and Futoshiki, 4 or 6 for
            mini-Sudoku.
        difficulty: ``"easy"``, ``"medium"`` or ``"hard"``: how many cells are empty (see the task classes,
            e.g. :class:`~lightning_llm.datamodules.tasks.puzzles.LatinSquareTask`).
        holes: Overrides the difficulty's number of empty cells (0 to ``n²``; never more than keep the
            solution unique).
        max_length: Token budget of one conversation. Puzzle prompts are long for their answer (rules, grid,
            inequalities): with the tiny tokenizer a 4x4 Latin square takes about 220 tokens, a 6x6 hard
            Futoshiki about 630, hence a larger default than the base's.
        **kwargs: The other arguments of :class:`~lightning_llm.datamodules.chat_sft.ChatSFTDataModule`
            (``num_train``, ``batch_size``, ``max_length``, ``packing``...), but not ``task``,
            ``task_kwargs`` or a ``source``, which the puzzle parameters replace.
    """

    def __init__(
        self,
        *,
        family: Literal["latin_square", "futoshiki", "mini_sudoku"] = "latin_square",
        size: int = 4,
        difficulty: Literal["easy", "medium", "hard"] = "easy",
        holes: int | None = None,
        max_length: int = 768,
        **kwargs: Any,
    ) -> None:
        if family not in _FAMILIES:
            raise ValueError(f"unknown puzzle family {family!r}; choose one of {_FAMILIES}")
        # task/task_kwargs are never passed by the CLI (set here, so jsonargparse drops them), but the source
        # arguments are, as their None defaults: only a real value clashes.
        clash = sorted(
            key for key in _FIXED if key in kwargs and (key.startswith("task") or kwargs[key] is not None)
        )
        if clash:
            raise ValueError(
                f"{type(self).__name__} builds its task from family/size/difficulty/holes; do not pass {clash} "
                "(use ChatSFTDataModule for another task or a real source)"
            )
        task_kwargs = {"size": size, "difficulty": difficulty, "holes": holes}
        super().__init__(task=family, task_kwargs=task_kwargs, max_length=max_length, **kwargs)
        # The base saved task/task_kwargs too; without them the hparams (what a checkpoint stores) are this
        # class's own arguments, so `PuzzleDataModule(**hparams)` (load_from_checkpoint) rebuilds it.
        for key in ("task", "task_kwargs"):
            self.hparams.pop(key)
