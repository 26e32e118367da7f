"""Models outside the four applications the suite started with: the kinds a new user tries first.

Each entry builds a compiled Keras model and its training data at a given batch size, with random weights and
synthetic data (no downloads): ``ZOO[name](batch, samples, seed) -> (model, x, y)``. ``y`` is None for models that
train on ``x`` alone (the GAN). Sizes are small so that a CPU run of a few steps takes seconds.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


class StepPeaks(keras.callbacks.Callback):
    """Records the GTBM device's peak (``peak_bytes_reserved``) of every training step in ``peaks``, and its peak
    bytes in use in ``in_use``."""

    def __init__(self):
        super().__init__()
        self.peaks: list[int] = []
        self.in_use: list[int] = []

    def on_train_batch_begin(self, batch, logs=None):
        from dymem_tf.memory import allocator

        allocator.reset_peak_stats()

    def on_train_batch_end(self, batch, logs=None):
        from dymem_tf.memory import allocator

        stats = allocator.memory_stats()
        self.peaks.append(int(stats["peak_bytes_reserved"]))
        self.in_use.append(int(stats["peak_bytes_in_use"]))


def _images(samples: int, size: int, seed: int, classes: int = 10):
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(samples, size, size, 3)).astype("float32"),
            rng.integers(0, classes, size=(samples,)))


def _application(name: str, size: int, optimizer):
    def build(batch: int, samples: int, seed: int):
        model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=10)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
        return (model, *_images(samples, size, seed))
    return build


def _sgd():
    return keras.optimizers.SGD(0.01, momentum=0.9)


def transformer_encoder(batch: int, samples: int, seed: int, seq: int = 64, dim: int = 128, layers: int = 2):
    """A Transformer encoder classifier (multi-head attention, layer norms, GELU MLP) trained with AdamW."""
    inp = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(1000, dim)(inp)
    for _ in range(layers):
        a = keras.layers.MultiHeadAttention(4, dim // 4)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(dim)(keras.layers.Dense(4 * dim, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + f)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.integers(0, 1000, size=(samples, seq)).astype("int32"), rng.integers(0, 10, size=(samples,))


class _PositionEmbedding(keras.layers.Layer):
    def __init__(self, length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.table = self.add_weight(shape=(length, dim), initializer="random_normal", name="positions")

    def call(self, x):
        return x + self.table[None, : x.shape[1]]


def gpt_decoder(batch: int, samples: int, seed: int, seq: int = 64, dim: int = 128, layers: int = 2,
                vocab: int = 2000):
    """A GPT-2-style decoder-only language model (pre-norm blocks, causal self-attention, GELU MLP, next-token
    loss) trained with AdamW. Built from layers, so it runs without keras-hub (:func:`gpt2` is keras_hub's
    backbone)."""
    inp = keras.Input((seq,), dtype="int32")
    h = _PositionEmbedding(seq, dim)(keras.layers.Embedding(vocab, dim)(inp))
    for _ in range(layers):
        n = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        h = h + keras.layers.MultiHeadAttention(4, dim // 4)(n, n, use_causal_mask=True)
        n = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        h = h + keras.layers.Dense(dim)(keras.layers.Dense(4 * dim, activation="gelu")(n))
    logits = keras.layers.Dense(vocab)(keras.layers.LayerNormalization(epsilon=1e-5)(h))
    model = keras.Model(inp, logits)
    model.compile(optimizer=keras.optimizers.AdamW(3e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(samples, seq + 1)).astype("int32")
    return model, tokens[:, :-1], tokens[:, 1:]


def unet(batch: int, samples: int, seed: int, size: int = 64, base: int = 16):
    """A U-Net for per-pixel classification (skip connections across the whole network) trained with Adam."""
    inp = keras.Input((size, size, 3))
    skips, h = [], inp
    for k in range(3):
        h = keras.layers.Conv2D(base << k, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(base << k, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(base << 3, 3, padding="same", activation="relu")(h)
    for k in reversed(range(3)):
        h = keras.layers.Conv2DTranspose(base << k, 2, strides=2, padding="same")(h)
        h = keras.layers.Concatenate()([h, skips[k]])
        h = keras.layers.Conv2D(base << k, 3, padding="same", activation="relu")(h)
    model = keras.Model(inp, keras.layers.Conv2D(4, 1)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return (model, rng.uniform(size=(samples, size, size, 3)).astype("float32"),
            rng.integers(0, 4, size=(samples, size, size)))


class Gate(keras.layers.Layer):
    """A data-dependent gate (the shape of stochastic depth and mixture routing): ``keras.ops.cond`` picks one of
    two branches by the feature map's mean, so the step holds a lowered conditional (Switch/Merge) per gate."""

    def call(self, x):
        return keras.ops.cond(keras.ops.mean(x) > 0.0, lambda: keras.ops.relu(x), lambda: x * 0.5)


def gated_cnn(batch: int, samples: int, seed: int, size: int = 64, width: int = 32, convs: int = 6):
    """A CNN with a :class:`Gate` after each of its ``convs`` convolutions, trained with Adam."""
    inp = keras.Input((size, size, 3))
    h = inp
    for _ in range(convs):
        h = Gate()(keras.layers.Conv2D(width, 3, padding="same")(h))
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return (model, *_images(samples, size, seed))


class GAN(keras.Model):
    """A DCGAN-style GAN: a custom ``train_step`` with two gradient tapes and two optimizers."""

    def __init__(self, size: int = 32, latent: int = 64):
        super().__init__()
        self.latent = latent
        self.generator = keras.Sequential([
            keras.Input((latent,)), keras.layers.Dense((size // 4) ** 2 * 64, activation="relu"),
            keras.layers.Reshape((size // 4, size // 4, 64)),
            keras.layers.Conv2DTranspose(64, 4, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(3, 3, padding="same", activation="sigmoid")], name="generator")
        self.discriminator = keras.Sequential([
            keras.Input((size, size, 3)), keras.layers.Conv2D(32, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2), keras.layers.Conv2D(64, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)],
            name="discriminator")
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.g_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)

    def train_step(self, data):
        real = data[0] if isinstance(data, tuple) else data
        n = tf.shape(real)[0]
        noise = keras.random.normal((n, self.latent), seed=self._seed())
        with tf.GradientTape() as tape:
            fake = self.generator(noise, training=True)
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            d_loss = self.bce(tf.ones_like(real_logits), real_logits) + self.bce(tf.zeros_like(fake_logits),
                                                                                fake_logits)
        grads = tape.gradient(d_loss, self.discriminator.trainable_variables)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_variables))
        with tf.GradientTape() as tape:
            fake_logits = self.discriminator(self.generator(noise, training=True), training=True)
            g_loss = self.bce(tf.ones_like(fake_logits), fake_logits)
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss}

    def _seed(self):
        if not hasattr(self, "_seed_gen"):
            self._seed_gen = keras.random.SeedGenerator(7)
        return self._seed_gen


def gan(batch: int, samples: int, seed: int, size: int = 32):
    model = GAN(size)
    model.compile()
    model.d_optimizer.build(model.discriminator.trainable_variables)
    model.g_optimizer.build(model.generator.trainable_variables)
    return model, _images(samples, size, seed)[0], None


def lstm(batch: int, samples: int, seed: int, seq: int = 32, features: int = 32):
    """An LSTM classifier: its loop feeds the backward pass, so Dymem leaves the step unmodified (with a warning)."""
    model = keras.Sequential([keras.Input((seq, features)), keras.layers.LSTM(64), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.normal(size=(samples, seq, features)).astype("float32"), rng.integers(0, 10, size=(samples,))


def lstm_text(batch: int, samples: int, seed: int, seq: int = 200, vocabulary: int = 20000):
    """An LSTM text classifier (issue 47): Embedding 20k x 128, LSTM(256) returning sequences, LSTM(256), Dense,
    trained with Adam. On the CPU each LSTM runs as a while loop whose accumulated lists are most of the step."""
    model = keras.Sequential([keras.Input((seq,), dtype="int32"), keras.layers.Embedding(vocabulary, 128),
                              keras.layers.LSTM(256, return_sequences=True), keras.layers.LSTM(256),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.integers(0, vocabulary, size=(samples, seq)).astype("int32"), rng.integers(0, 2, size=(samples,))


def gated_cnn_wide(batch: int, samples: int, seed: int):
    """The gated CNN of issue 47: 6 gated convolutions of 64 channels at 32px (batch 64 in its measurements)."""
    return gated_cnn(batch, samples, seed, size=32, width=64, convs=6)


def _keras_hub(model: str):
    """The ``keras_hub`` module, or an ImportError saying how to install it (the ``bench`` extra)."""
    try:
        import keras_hub
    except ImportError as err:
        raise ImportError(f"the {model} model needs keras-hub: pip install --no-build-isolation -e '.[bench]'") from err
    return keras_hub


def _compile_hub(model: keras.Model) -> None:
    """Compiles a keras_hub model with a logits head as the zoo trains them: AdamW at 1e-4, sparse cross-entropy."""
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def bert(batch: int, samples: int, seed: int, layers: int = 4, hidden: int = 256, intermediate: int = 1024,
         heads: int = 4, seq: int = 128):
    """keras_hub's BERT backbone built from a configuration (random weights, no download) with a 3-class head on
    ``pooled_output``, trained with AdamW: token, segment and padding-mask inputs (a dict), einsum attention,
    dropout, tanh-GELU. Needs ``keras-hub`` (the ``bench`` extra)."""
    hub = _keras_hub("bert")
    backbone = hub.models.BertBackbone(vocabulary_size=30522, num_layers=layers, num_heads=heads, hidden_dim=hidden,
                                       intermediate_dim=intermediate, max_sequence_length=seq)
    model = keras.Model(backbone.input, keras.layers.Dense(3)(backbone.output["pooled_output"]))
    _compile_hub(model)
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(0, 30522, (samples, seq)).astype("int32"),
         "segment_ids": np.zeros((samples, seq), "int32"), "padding_mask": np.ones((samples, seq), "int32")}
    return model, x, rng.integers(0, 3, (samples,))


def bert_base(batch: int, samples: int, seed: int):
    """BERT-base's configuration (12 layers, 768 wide, 12 heads, intermediate 3072, sequence 128)."""
    return bert(batch, samples, seed, layers=12, hidden=768, intermediate=3072, heads=12)


def gpt2(batch: int, samples: int, seed: int, layers: int = 4, hidden: int = 256, intermediate: int = 1024,
         heads: int = 4, seq: int = 128, classes: int = 1000):
    """keras_hub's GPT-2 backbone (a causal decoder) built from a configuration (random weights, no download) with
    a next-token head over ``classes`` tokens (the vocabulary cut down to keep the logits small), trained with
    AdamW. Needs ``keras-hub`` (the ``bench`` extra)."""
    hub = _keras_hub("gpt2")
    backbone = hub.models.GPT2Backbone(vocabulary_size=50257, num_layers=layers, num_heads=heads, hidden_dim=hidden,
                                       intermediate_dim=intermediate, max_sequence_length=seq)
    model = keras.Model(backbone.input, keras.layers.Dense(classes)(backbone.output))
    _compile_hub(model)
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(0, 50257, (samples, seq)).astype("int32"),
         "padding_mask": np.ones((samples, seq), "int32")}
    return model, x, rng.integers(0, classes, (samples, seq))


ZOO = {
    "vgg16": _application("VGG16", 32, _sgd),
    "resnet50_sgd": _application("ResNet50", 32, _sgd),
    "resnet50_adam": _application("ResNet50", 32, lambda: keras.optimizers.Adam(1e-3)),
    "densenet121": _application("DenseNet121", 32, _sgd),
    "inception_v3": _application("InceptionV3", 75, _sgd),
    "mobilenet_v2": _application("MobileNetV2", 32, lambda: keras.optimizers.Adam(1e-3)),
    "efficientnet_b0": _application("EfficientNetB0", 32, lambda: keras.optimizers.Adam(1e-3)),
    "resnet152": _application("ResNet152", 128, _sgd),  # a big CNN at 128px (issue 29's big-model suite)
    # issue 47's models: grouped convolutions run as calls TF does not inline, loops, conditionals
    "convnext_tiny": _application("ConvNeXtTiny", 64, lambda: keras.optimizers.AdamW(1e-3)),
    "lstm_text": lstm_text,
    "gated_cnn_wide": gated_cnn_wide,
    "transformer_encoder": transformer_encoder,
    "gpt_decoder": gpt_decoder,
    "unet": unet,
    "gated_cnn": gated_cnn,
    "gan": gan,
    "lstm": lstm,
    "bert": bert,
    "bert_base": bert_base,
    "gpt2": gpt2,
}
