"""pipeline.sampling: the sampler parameters' wire form, which engine honours what, and the stop-string matcher."""

from __future__ import annotations

import random

import pytest

from pipeline.sampling import ENGINE_PARAMS, Sampling, SamplingRefused, StopMatcher, check_engine, decode, encode


def test_a_request_without_sampler_parameters_carries_nothing() -> None:
    assert encode(Sampling()) == ""
    assert decode("") == Sampling()


def test_the_wire_form_round_trips() -> None:
    s = Sampling(stop=("a", "\n\n"), seed=3, temperature=0.0, top_p=0.9, presence_penalty=0.5, logprobs=2,
                 response_format={"type": "json_object"}, tools=({"type": "function"},), tool_choice="auto")
    assert decode(encode(s)) == s


def test_values_that_change_nothing_are_not_asked() -> None:
    assert Sampling(top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    response_format={"type": "text"}).asked() == []
    assert Sampling(tools=({"type": "function"},), tool_choice="none").asked() == []
    assert Sampling(temperature=0.0).asked() == ["temperature"]


@pytest.mark.parametrize("engine", sorted(ENGINE_PARAMS))
def test_each_engine_refuses_exactly_what_it_does_not_honour(engine: str) -> None:
    every = {
        "stop": Sampling(stop=("x",)), "seed": Sampling(seed=1), "temperature": Sampling(temperature=0.5),
        "top_p": Sampling(top_p=0.5), "presence_penalty": Sampling(presence_penalty=1.0),
        "frequency_penalty": Sampling(frequency_penalty=1.0), "logprobs": Sampling(logprobs=0),
        "response_format": Sampling(response_format={"type": "json_object"}),
        "tools": Sampling(tools=({"type": "function"},)),
    }
    for param, s in every.items():
        if param in ENGINE_PARAMS[engine]:
            check_engine(s, engine)
        else:
            with pytest.raises(SamplingRefused) as e:
                check_engine(s, engine)
            assert e.value.param == param and param in str(e.value)


def _run(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_a_stop_string_across_tokens_is_cut_with_what_follows() -> None:
    assert _run(("the end",), ["once ", "upon th", "e e", "nd and more"]) == ("once upon ", True)


def test_text_that_only_starts_like_a_stop_string_is_released() -> None:
    m = StopMatcher(("abc",))
    assert m.feed("xab") == ("x", False)  # "ab" may become "abc": held
    assert m.feed("d") == ("abd", False)  # it did not
    assert m.feed("a") == ("", False)
    assert m.flush() == "a"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert _run(("zz", "b"), ["aabzz"]) == ("aa", True)


def test_the_matcher_agrees_with_a_search_of_the_whole_text() -> None:
    """Random texts cut into random pieces (tokens): the answer ends at the first token after which the text holds a
    stop string, cut at the earliest stop string in that text (vLLM checks after each token the same way); with no
    stop string, all of it is released, whatever the cuts."""
    rng = random.Random(5)
    for _ in range(2000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 30)))
        stops = tuple({"".join(rng.choice("ab ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        expect = (text, False)
        seen = ""
        for piece in pieces:
            seen += piece
            first = min((i for i in (seen.find(s) for s in stops) if i >= 0), default=-1)
            if first >= 0:
                expect = (seen[:first], True)
                break
        assert _run(stops, pieces) == expect, (text, stops, pieces)


def test_logprobs_wire_form_round_trips_and_formats_as_openai() -> None:
    from pipeline.openai_format import chat_logprobs, completion_logprobs
    from pipeline.sampling import decode_logprobs, encode_logprobs

    entries = [(-0.25, "Hel", (("Hel", -0.25), ("He", -1.5))), (-9999.0, "lo", ())]
    assert decode_logprobs(encode_logprobs(entries)) == entries
    assert decode_logprobs("") == []
    chat = chat_logprobs(entries)["content"]
    assert chat[0] == {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108],
                       "top_logprobs": [{"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                                        {"token": "He", "logprob": -1.5, "bytes": [72, 101]}]}
    assert chat[1]["top_logprobs"] == []
    legacy = completion_logprobs(entries, offset=4)
    assert legacy == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.25, -9999.0],
                      "top_logprobs": [{"Hel": -0.25, "He": -1.5}, {}], "text_offset": [4, 7]}
