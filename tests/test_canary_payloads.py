"""gateway.payloads: reading and continuing OpenAI request/response bodies (pure functions)."""

import pytest

from gateway.payloads import continuation, is_greedy, same_words, tokens_left, words

CHAT = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 10, "temperature": 0, "stream": True}


def test_completion_continues_the_prompt_with_fewer_tokens():
    body = {"prompt": "Q: 2+2? A:", "max_tokens": 10, "min_tokens": 3, "n": None, "stream": True}
    out = continuation(body, " four and", 2, chat=False)
    assert out == {**body, "prompt": "Q: 2+2? A: four and", "max_tokens": 8, "min_tokens": 1}
    assert body["prompt"] == "Q: 2+2? A:" and body["max_tokens"] == 10  # the client's body is not changed


def test_chat_continues_as_final_assistant_message():
    out = continuation({**CHAT, "max_completion_tokens": 6}, "It is", 2, chat=True)
    assert out["messages"] == [*CHAT["messages"], {"role": "assistant", "content": "It is"}]
    assert (out["continue_final_message"], out["add_generation_prompt"]) == (True, False)
    assert (out["max_tokens"], out["max_completion_tokens"]) == (8, 4)


def test_chat_that_already_continues_an_assistant_message_appends_to_it():
    body = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "The answer:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    out = continuation(body, " 4", 1, chat=True)
    assert out["messages"][-1] == {"role": "assistant", "content": "The answer: 4"} and len(out["messages"]) == 2


@pytest.mark.parametrize(
    "body, chat",
    [
        ({"prompt": ["a", "b"], "max_tokens": 5}, False),  # a batch of prompts
        ({"prompt": [1, 2, 3], "max_tokens": 5}, False),  # token ids
        ({"prompt": "a", "n": 2}, False),  # choices interleave
        ({"prompt": "a", "best_of": 3}, False),
        ({"prompt": "a", "echo": True}, False),  # the sent text starts with the prompt
        ({"prompt": "a", "max_tokens": 3.0}, False),  # a limit that cannot be lowered exactly
        ({"prompt": "a", "max_tokens": "3"}, False),
        ({"messages": "hi"}, True),
        ({"messages": []}, True),
        (
            {
                "messages": [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}],
                "continue_final_message": True,
            },
            True,
        ),  # content parts: no string to extend
    ],
)
def test_requests_that_cannot_be_continued(body, chat):
    assert continuation(body, "x", 1, chat=chat) is None


def test_tokens_left_takes_the_smaller_limit_and_none_without_one():
    assert tokens_left({"max_tokens": 10, "max_completion_tokens": 4}, 3) == 1
    assert tokens_left({"max_tokens": 2}, 5) == 0
    assert tokens_left({"max_tokens": True}, 0) is None and tokens_left({}, 7) is None


def test_malformed_chunks_read_as_no_text_and_no_usage():
    from gateway.payloads import chunk_text, completion_tokens, other_delta, response_text

    for chunk in (
        {"choices": [{"delta": "oops"}]},
        {"choices": [{"text": 5}]},
        {"choices": "abc"},
        {"choices": {"0": {"text": "x"}}},
        {"choices": [None]},
        {},
    ):
        assert chunk_text(chunk) == "" and response_text(chunk) == "" and not other_delta(chunk)
    assert (
        completion_tokens({"usage": "bad"}) is None
        and completion_tokens({"usage": {"completion_tokens": True}}) is None
    )
    assert other_delta({"choices": [{"delta": {"role": "assistant", "tool_calls": [{"id": "1"}]}}]})
    assert not other_delta({"choices": [{"delta": {"role": "assistant", "content": "", "tool_calls": []}}]})


def test_greedy_and_same_words():
    assert is_greedy({"temperature": 0}) and not is_greedy({}) and not is_greedy({"temperature": 0, "n": 2})
    assert not is_greedy({"temperature": False})
    assert same_words(" four apples", "four apples and", 2) and not same_words("4", "4 apples", 2)
    # what a reader calls the same answer: case and the punctuation around words do not count
    assert same_words("5 + 5 = 10", "5 + 5 = 10.", 8) and same_words("The capital is Paris.", "the capital is PARIS", 8)
    assert not same_words("14 + 14 = 25", "14 + 14 = 20", 8) and not same_words("don't", "dont", 8)
    assert not same_words("5 + 5 = 10", "5 - 5 = 10", 8)  # an operator is a word
    assert words('Hi , "there" **you**!', 3) == ["hi", "there", "you"]
