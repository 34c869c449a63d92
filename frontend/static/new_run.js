// The new-run form: choosing starting weights fills in the model fields they fix (all but the sequence length,
// which a run picks for itself), and choosing a dataset raises the vocabulary to hold every id of its tokenizer.
// The service fills what the form has no field for (an imported Llama's norm epsilon, its RoPE scaling).
(() => {
  const sources = JSON.parse(document.getElementById("run-sources").textContent);
  const form = document.querySelector("form.run-form");
  const input = (path) => form.elements.namedItem(path);

  function fillFromSources() {
    const model = sources.initModels[input("checkpoint.init_from").value];
    for (const [field, value] of Object.entries(model || {})) {
      const element = input(`model.${field}`);
      if (element && field !== "seq_len" && value !== null && typeof value !== "object") element.value = String(value);
    }
    const vocab = sources.datasetVocab[input("data.dataset").value];
    const vocabInput = input("model.vocab");
    if (vocab && Number(vocabInput.value) < vocab) vocabInput.value = String(vocab);
  }

  input("checkpoint.init_from").addEventListener("change", fillFromSources);
  input("data.dataset").addEventListener("change", fillFromSources);
})();
