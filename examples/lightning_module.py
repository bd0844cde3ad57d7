"""A PyTorch Lightning module whose ``configure_optimizers`` returns a fuser optimizer and a
learning-rate scheduler stepped every batch.

    python examples/lightning_module.py [--steps N]

On a machine with no GPU the model runs on CPU and the optimizer's kernel through Triton's
interpreter.
"""

import argparse

import lightning as L
import torch

import fuser


# --8<-- [start:lightning]
@fuser.rule(hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0), state=dict(m=0.0))
def lion(p, g, m, *, lr, beta1, beta2, weight_decay, step):
    u = fuser.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    p = p * (1 - lr * weight_decay) - lr * u
    return dict(p=p, m=m)


Lion = fuser.compile(lion)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2, weight_decay: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = Lion(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        # Warmup then cosine decay. (The rule's betas are hyperparameters beta1 and beta2,
        # not torch's `betas` pair that cycle_momentum would cycle.)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, cycle_momentum=False, total_steps=self.trainer.max_steps
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# --8<-- [end:lightning]


class Record(L.Callback):
    """Loss and learning rate of every step."""

    def __init__(self):
        self.rows = []
        self.lr = None

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, outputs["loss"].item(), self.lr))


def main(steps: int = 30) -> list[tuple[int, float, float]]:
    torch.manual_seed(0)
    x = torch.randn(512, 13)
    y = torch.tanh(0.5 * x @ torch.linspace(-1, 1, 13)[:, None])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    record = Record()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(Regressor(), loader)
    assert isinstance(trainer.optimizers[0], Lion)
    for step, loss, lr in record.rows:
        print(f"step {step:3d}  loss {loss:.4f}  lr {lr:.2e}")
    print(f"fuser.stats() = {fuser.stats()}")
    return record.rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args().steps)
