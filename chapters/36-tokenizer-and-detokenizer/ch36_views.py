"""Pictures for Chapter 36's notebook: BPE merges on a word, the byte-to-symbol map, and a
stream of tokens with what the incremental detokenizer releases after each one."""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

PLAIN, NEW, MOVED, HELD = "#dbe9f6", "#f58518", "#f2c6a0", "#eeeeee"


def merge_rows(tokenizer, module, word_symbols):
    """[(merge applied or None, its rank or None, symbols after it)] for one word: the merges
    `tokenizer.encode_word` makes on it, in the order it makes them, recorded by watching the
    calls it makes to `module.merge_word` (the module the tokenizer's class comes from).

    word_symbols: the word spelled in the byte alphabet."""
    made = []
    original = module.merge_word

    def recording(symbols, pair):
        merged = original(symbols, pair)
        made.append((pair, tokenizer.merge_ranks.get(pair), merged))
        return merged

    module.merge_word = recording
    try:
        tokenizer.encode_word(word_symbols)
    finally:
        module.merge_word = original
    return [(None, None, tuple(word_symbols)), *made]


def draw_merges(rows, ax=None, title=None):
    """One row of boxes per step: each box a symbol spanning the characters it covers; the
    symbol the step's merge made is orange."""
    width = len("".join(rows[0][2]))
    ax = ax or plt.subplots(figsize=(0.55 * width + 3, 0.5 * len(rows) + 0.6))[1]
    for r, (merge, rank, symbols) in enumerate(rows):
        y, x = len(rows) - 1 - r, 0
        joined = None if merge is None else merge[0] + merge[1]
        for symbol in symbols:
            colour = NEW if symbol == joined else PLAIN
            ax.add_patch(Rectangle((x + 0.05, y + 0.1), len(symbol) - 0.1, 0.8, facecolor=colour, edgecolor="#555555"))
            ax.text(x + len(symbol) / 2, y + 0.5, symbol, ha="center", va="center", family="monospace", fontsize=11)
            x += len(symbol)
        label = "bytes" if merge is None else f"{merge[0]} + {merge[1]}  (rank {rank:,})"
        ax.text(width + 0.3, y + 0.5, label, va="center", family="monospace", fontsize=9)
    ax.set_xlim(0, width + 8)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    if title:
        ax.set_title(title)
    return ax


def draw_byte_map(byte_to_symbol, ax=None):
    """The 256 bytes in a 16 x 16 grid (row = high nibble), each with the symbol that spells it;
    bytes moved to U+0100 onwards (they had no printable character of their own) shaded."""
    ax = ax or plt.subplots(figsize=(8.5, 8.5))[1]
    for b in range(256):
        row, col = divmod(b, 16)
        symbol = byte_to_symbol[b]
        moved = ord(symbol) >= 256
        ax.add_patch(Rectangle((col, 15 - row), 1, 1, facecolor=MOVED if moved else PLAIN, edgecolor="white"))
        ax.text(col + 0.5, 15 - row + 0.5, symbol, ha="center", va="center", fontsize=10)
    ax.set_xticks([c + 0.5 for c in range(16)], [f"{c:X}" for c in range(16)])
    ax.set_yticks([15 - r + 0.5 for r in range(16)], [f"{r:X}_" for r in range(16)])
    ax.tick_params(length=0)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 16)
    ax.set_aspect("equal")
    ax.set_title("byte -> symbol (shaded: moved to U+0100 and up)")
    return ax


def shown(text):
    """Text for a figure's label: quoted, characters the default font lacks as U+XXXX."""
    return repr("".join(c if ord(c) < 0x250 else f"U+{ord(c):04X}" for c in text))


def draw_stream(token_bytes, released, ax=None):
    """One column per token: its bytes in hex on top, what push() released underneath
    (grey: held back, nothing released)."""
    n = len(token_bytes)
    ax = ax or plt.subplots(figsize=(1.25 * n + 1, 2.4))[1]
    for i, (data, text) in enumerate(zip(token_bytes, released)):
        ax.add_patch(Rectangle((i + 0.05, 1.1), 0.9, 0.8, facecolor=PLAIN, edgecolor="#555555"))
        hex_lines = "\n".join(data[j:j + 2].hex(" ") for j in range(0, len(data), 2))
        ax.text(i + 0.5, 1.5, hex_lines, ha="center", va="center", family="monospace", fontsize=8)
        ax.add_patch(Rectangle((i + 0.05, 0.1), 0.9, 0.8, facecolor=NEW if text else HELD, edgecolor="#555555"))
        ax.text(i + 0.5, 0.5, shown(text) if text else "held", ha="center", va="center", fontsize=9)
    ax.text(-0.1, 1.5, "token bytes", ha="right", va="center", fontsize=9)
    ax.text(-0.1, 0.5, "push() returns", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, n)
    ax.set_ylim(0, 2)
    ax.axis("off")
    return ax
