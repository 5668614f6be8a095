"""Statistics definitions that hold by construction for plain decoding."""
from quickdraft.engine.loop import generate_tokens
from quickdraft.spec.sampling import SamplingParams
from tiny_models import hf_model, ours_from_hf


def test_plain_decoding_commits_one_token_per_pass_even_when_it_stops():
    model = ours_from_hf(hf_model("llama-gqa-untied"))
    prompt = [3, 4, 5]
    ids = [t for ev in generate_tokens(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
           for t in ev.token_ids]
    stop = ids[5]
    events = list(generate_tokens(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                                 stop_token_ids=(stop,))))
    stats = events[-1].stats
    assert events[-1].finish_reason == "stop" and stats.new_tokens == ids.index(stop)
    # The stop token was committed by a target pass but is not output.
    assert stats.committed_tokens == stats.new_tokens + 1 == stats.target_passes
    assert stats.tokens_per_pass == 1.0
