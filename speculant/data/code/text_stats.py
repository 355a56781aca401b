import re
from collections import Counter

WORD = re.compile(r"[A-Za-z']+")


def tokenize(text):
    # Wörter in Kleinbuchstaben, Satzzeichen werden entfernt
    return [w.lower() for w in WORD.findall(text)]


def word_counts(text, stopwords=()):
    # zählt jedes Wort, das kein Stoppwort ist
    counts = Counter()
    for word in tokenize(text):
        if word not in stopwords:
            counts[word] += 1
    return counts


def top_words(text, n=10, stopwords=()):
    # die n häufigsten Wörter, bei Gleichstand alphabetisch
    counts = word_counts(text, stopwords)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def sentence_lengths(text):
    # Länge jedes Satzes in Wörtern; leere Sätze werden übersprungen
    sentences = re.split(r"[.!?]+", text)
    return [len(tokenize(s)) for s in sentences if tokenize(s)]


def average_sentence_length(text):
    lengths = sentence_lengths(text)
    # Durchschnitt, oder 0 wenn der Text keine Sätze enthält
    return sum(lengths) / len(lengths) if lengths else 0.0


def lexical_density(text, stopwords=()):
    words = tokenize(text)
    if not words:
        return 0.0
    content = [w for w in words if w not in stopwords]
    # Anteil der Inhaltswörter an allen Wörtern
    return len(content) / len(words)


if __name__ == "__main__":
    sample = "The cat sat. The cat ran away! Where did the cat go?"
    print(top_words(sample, 3, stopwords={"the"}))
    print(average_sentence_length(sample), lexical_density(sample, {"the"}))
