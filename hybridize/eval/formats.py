"""Answer formats of the math evaluations and GRPO prompts: the instruction appended after each problem."""

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
NUMBER_INSTRUCTION = "Answer with the number only."
#: answer formats: the instruction after the problem; `grade` checks the answer by the same format
ANSWER_FORMATS = {"boxed": BOXED_INSTRUCTION, "number": NUMBER_INSTRUCTION}
