"""DataModules tokenize with the fitted model's tokenizer, and a mismatch cannot go unnoticed."""

import pytest

from lightning_llm.datamodules import ChatSFTDataModule, PromptDataModule
from lightning_llm.datamodules.tokenizer import TokenizerMismatchError
from lightning_llm.modules import CausalLMModule


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_backbone, tmp_path_factory):
    """The tiny model saved with one more token: the same model family, a different vocabulary."""
    model, tokenizer = tiny_backbone
    directory = tmp_path_factory.mktemp("extended")
    extended = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    extended.add_tokens(["<extra_tool_token>"])
    model.save_pretrained(directory)
    extended.save_pretrained(directory)
    return str(directory)


def test_unset_tokenizer_is_the_fitted_models(other_tokenizer_dir, quiet_trainer):
    module = CausalLMModule(other_tokenizer_dir)
    data = ChatSFTDataModule(task="copy", num_train=4, num_val=0, batch_size=2)
    data.setup("fit")  # standalone first: the tiny tokenizer
    assert "<extra_tool_token>" not in data.tokenizer.get_vocab()
    quiet_trainer(max_steps=1).fit(module, data)
    assert data.tokenizer is module.tokenizer  # rebuilt with the model's tokenizer when fitted
    assert data.tokenizer.convert_tokens_to_ids("<extra_tool_token>") == len(module.tokenizer) - 1


def test_named_tokenizer_that_differs_from_the_models_is_refused(other_tokenizer_dir, quiet_trainer):
    module = CausalLMModule("tiny")
    data = PromptDataModule(task="arithmetic", tokenizer=other_tokenizer_dir, num_train=4, num_val=0)
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        quiet_trainer(max_steps=1).fit(module, data)


def test_named_tokenizer_equal_to_the_models_is_accepted(tiny_backbone, quiet_trainer):
    module = CausalLMModule("tiny")
    data = ChatSFTDataModule(task="copy", tokenizer="tiny", num_train=4, num_val=0, batch_size=2)
    quiet_trainer(max_steps=1).fit(module, data)
    assert (
        data.tokenizer is not module.tokenizer and data.tokenizer.get_vocab() == module.tokenizer.get_vocab()
    )
