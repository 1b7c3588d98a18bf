"""The multi-turn driver over VLLMEngine: the sampler's log-probs line up with the trainer's on the
policy's own tokens and are 0 on the tool messages the driver inserted."""

import torch

from tests.rollout._vllm import LOGP_ATOL, make_engine, trainer_logp
from grouprl.policy import load_policy, load_tokenizer
from grouprl.rollout import SamplingParams
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tasks import TOOL_POLICY_DIR
from grouprl.tasks.products import mul, train_rows
from grouprl.tools import get_tool_parser, resolve_tools


def test_vllm_trajectories_carry_sampler_logprobs_on_actions_only():
    tok = load_tokenizer(str(TOOL_POLICY_DIR))
    model = load_policy(str(TOOL_POLICY_DIR)).eval()
    engine = make_engine(TOOL_POLICY_DIR, tok)
    try:
        tools = resolve_tools([mul])
        driver = MultiTurnDriver(tok, TurnLimits(80, max_turns=2, max_tool_calls=1), tools=tools,
                                 parser=get_tool_parser(tok, tools), eos_token_ids=(tok.eos_token_id,))
        ids = [tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=False) for r in train_rows()[:8]]
        traj = driver.generate(engine, ids, 4, SamplingParams(80, temperature=1.0), torch.Generator().manual_seed(0))
    finally:
        engine.close()
    ro = traj.rollout
    context = ro.completion_mask & ~ro.action_mask  # [N, T]
    assert context.any(1).sum() >= 4  # some trajectories called the tool and got its result
    assert torch.equal(ro.sampling_logp[context], torch.zeros(int(context.sum())))
    logp = trainer_logp(model, ro)  # [N, T']
    T = logp.shape[1]
    acts = ro.action_mask[:, :T]
    assert float((logp - ro.sampling_logp[:, :T]).abs()[acts].max()) <= LOGP_ATOL
    assert all(m[-1]["role"] == "assistant" for m in traj.messages)
