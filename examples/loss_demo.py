"""A new loss epilogue as math: soft-capped cross-entropy with a z-loss and an entropy bonus,
compiled into a fused linear + loss whose gradient fuser derives, checked against the same
loss on materialised logits, then used to train a tiny language-model head.

On a machine with no GPU the kernel runs through Triton's interpreter on CPU tensors.
"""

import torch

import fuser

loss_rule = fuser.loss(
    """
    z = cap * tanh(z / cap)
    lse = logsumexp(z)
    entropy = lse - sum(exp(z - lse) * z)
    loss = lse - z[y] + z_loss * lse**2 - beta * entropy
""",
    name="softcap_ce_zloss_entropy",
    hyper=dict(cap=15.0, z_loss=1e-4, beta=0.01),
)

head_loss = fuser.compile(loss_rule, chunk_size=64)
print("Generated Triton kernel (the derived gradient is quoted at its top):")
print(head_loss.source)

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
T, H, V = 65, 32, 301
hidden = torch.randn(T, H, device=device, requires_grad=True)
weight = (torch.randn(V, H, device=device) * 0.1).requires_grad_()
target = torch.randint(0, V, (T,), device=device)
target[::7] = -100  # ignored positions

loss = head_loss(hidden, weight, target)
loss.backward()


def reference(hidden, weight, target, cap=15.0, z_loss=1e-4, beta=0.01):
    z = cap * torch.tanh(hidden @ weight.T / cap)
    lse = torch.logsumexp(z, 1)
    p = torch.softmax(z, 1)
    entropy = lse - (p * z).sum(1)
    valid = target != -100
    zy = z.gather(1, target.clamp(min=0)[:, None])[:, 0]
    per_token = (lse - zy + z_loss * lse**2 - beta * entropy) * valid
    return per_token.sum() / valid.sum()


h64 = hidden.detach().double().requires_grad_()
w64 = weight.detach().double().requires_grad_()
ref = reference(h64, w64, target)
ref.backward()
print(f"loss {loss.item():.6f} (float64 on materialised logits: {ref.item():.6f})")
print(
    f"max |grad_hidden error| {(hidden.grad.double() - h64.grad).abs().max():.2e}, "
    f"max |grad_weight error| {(weight.grad.double() - w64.grad).abs().max():.2e}"
)

opt = torch.optim.SGD([weight], lr=0.5)
for step in range(8):
    opt.zero_grad()
    loss = head_loss(hidden.detach(), weight, target)
    loss.backward()
    opt.step()
    if step % 2 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")
print(f"step  7  loss {loss.item():.4f}")
