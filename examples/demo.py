"""fuser's main job in one script: define a new optimizer as math, compile it into one
fused Triton kernel, read the kernel, and train with it.

On a machine with no GPU the kernel runs through Triton's interpreter on CPU tensors.
"""

import torch

import fuser

# A new optimizer: Adam's moments, a Lion-style sign update blended with the Adam
# direction, and decoupled weight decay. Written once, as math.
lionadam = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    adam = (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    u = mix * sign(m) + (1 - mix) * adam
    p = p * (1 - lr * weight_decay) - lr * u
""",
    name="lionadam",
    hyper=dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, mix=0.3, weight_decay=0.01),
    state=dict(m=0.0, v=0.0),
)

LionAdam = fuser.compile(lionadam)
print("Generated Triton kernel (one launch per step for every parameter):")
print(LionAdam.source)

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(256, 13, device=device)
true_w = torch.randn(13, 1, device=device)
y = torch.sin(x @ true_w) + 0.05 * torch.randn(256, 1, device=device)
model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 1)).to(device)
opt = LionAdam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60)

print(f"Training a small MLP on {device} with {len(list(model.parameters()))} tensors:")
first = None
for step in range(1, 61):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    first = first if first is not None else loss.item()
    if step % 10 == 0 or step == 1:
        print(f"  step {step:3d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.5f}")
print(f"loss {first:.4f} -> {loss.item():.4f}; fuser.stats() = {fuser.stats()}")
assert loss.item() < first, "the loss did not fall"
