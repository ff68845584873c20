// The try-it page: a form over the images API, streamed with live previews. No framework, no build step.
"use strict";

const settings = JSON.parse(document.getElementById("settings").textContent);
const form = document.getElementById("form");
const button = document.getElementById("generate");
const results = document.getElementById("results");
const PARTIAL_IMAGES = 2;
const keyInput = document.getElementById("api_key");
const KEY_STORAGE = "omni-ray-api-key";  // kept for this tab only

document.body.classList.toggle("keyed", settings.api_key);
keyInput.value = sessionStorage.getItem(KEY_STORAGE) ?? "";

document.body.classList.toggle("edit", settings.edit);
// Qwen-Image-Layered: an image decomposed into RGBA layers, shown over a checkerboard and composited.
const layered = settings.layered;
document.body.classList.toggle("layered", layered !== null);
document.getElementById("model").textContent = layered
  ? `${settings.model}: image to layers, ${layered.default_layers} layers at resolution ${layered.resolutions[0]} ` +
    `and ${settings.default_steps} steps by default`
  : `${settings.model}: ${settings.edit ? "image editing" : "text to image"}, ` +
    `${settings.default_size} and ${settings.default_steps} steps by default`;
document.getElementById("size").placeholder = settings.edit ? "from the image" : settings.default_size;
document.getElementById("num_inference_steps").placeholder = String(settings.default_steps);
for (const size of settings.sizes) {
  const option = document.createElement("option");
  option.value = size;
  document.getElementById("sizes").append(option);
}

const imageInput = document.getElementById("image");
if (settings.max_images > 1) {  // Edit-Plus: several images, in the order picked
  imageInput.multiple = true;
  document.querySelector('label[for="image"]').textContent = `Images to edit (up to ${settings.max_images})`;
}
const LANGUAGES = { en: "English", zh: "Chinese" };
if (layered) {
  const layers = document.getElementById("layers");
  layers.min = String(layered.min_layers);  // the client check reads the input's own bounds
  layers.max = String(layered.max_layers);
  layers.value = String(layered.default_layers);
  for (const side of layered.resolutions) {
    document.getElementById("resolution").append(new Option(String(side), side));  // the square's area
  }
  for (const language of layered.caption_languages) {
    document.getElementById("caption_language").append(new Option(LANGUAGES[language] ?? language, language));
  }
  document.querySelector('label[for="image"]').textContent = "Image to decompose (its transparency is kept)";
  document.getElementById("image-preview").classList.add("checker");
  document.getElementById("prompt").placeholder =
    "optional: left empty, the server captions the image and uses the caption (Enter decomposes)";
  button.textContent = "Decompose";
}
imageInput.addEventListener("change", () => {
  const preview = document.getElementById("image-preview");
  const file = imageInput.files[0];
  preview.hidden = !file;
  if (file) preview.src = URL.createObjectURL(file);
});

// ControlNets (a text-to-image preset that holds some): up to max_controls, each a row of the form, sent as a
// multipart form with the control images as files.
const controlList = document.getElementById("controls");
const addControl = document.getElementById("add-control");
document.body.classList.toggle("controlled", settings.controlnets.length > 0);
addControl.addEventListener("click", newControl);

function newControl() {
  const control = document.getElementById("control-template").content.firstElementChild.cloneNode(true);
  for (const name of settings.controlnets) control.querySelector("select").append(new Option(name, name));
  const input = control.querySelector('input[type="file"]');
  input.addEventListener("change", async () => {
    const preview = control.querySelector(".control-preview");
    const file = input.files[0];
    preview.hidden = !file;
    if (!file) return;
    preview.src = URL.createObjectURL(file);
    const size = document.getElementById("size");
    if (size.value.trim() === "") size.value = (await imageSize(file)).join("x");  // the output takes its size
  });
  control.querySelector(".remove").addEventListener("click", () => {
    control.remove();
    numberControls();
  });
  controlList.append(control);
  numberControls();
}

function numberRows(list, field, idPrefix) {
  // Each row's parts are named as the server names them in an error (control[k].scale, loras[k].name), so a message
  // shows beside its part.
  list.querySelectorAll(":scope > div").forEach((row, k) => {
    row.dataset.field = `${field}[${k}]`;
    for (const part of row.querySelectorAll("[data-part]")) {
      const id = `${idPrefix}-${k}-${part.dataset.part}`;
      part.dataset.field = `${field}[${k}].${part.dataset.part}`;
      part.querySelector("input, select").id = id;
      part.querySelector("label").htmlFor = id;
    }
  });
}

function numberControls() {
  numberRows(controlList, "control", "control");
  addControl.disabled = controlList.children.length >= settings.max_controls;
  addControl.textContent = controlList.children.length ? "Add another ControlNet" : "Add a ControlNet";
}

// LoRA adapters (a preset with some, or run-time ones allowed): a stack of up to max_loras, each with its weight,
// picked from the server's model list (GET /v1/models: the base model, then the adapters).
const adapterList = document.getElementById("adapters");
const addAdapter = document.getElementById("add-adapter");
document.body.classList.toggle("adapted", settings.max_loras > 0);
addAdapter.addEventListener("click", newAdapter);

async function newAdapter() {
  clearErrors();
  const response = await fetch("/v1/models", { headers: keyHeaders() });
  const listed = await response.json().catch(() => null);
  if (!response.ok) {
    showError(response.status === 401 ? "api_key" : "loras", listed?.error?.message ?? `HTTP ${response.status}`);
    return;
  }
  const names = listed.data.filter((model) => model.parent !== undefined).map((model) => model.id);
  if (!names.length) {
    showError("loras", "this server has no adapters yet");
    return;
  }
  const adapter = document.getElementById("adapter-template").content.firstElementChild.cloneNode(true);
  const taken = Array.from(adapterList.querySelectorAll("select"), (select) => select.value);
  for (const name of names) adapter.querySelector("select").append(new Option(name, name));
  adapter.querySelector("select").value = names.find((name) => !taken.includes(name)) ?? names[0];
  adapter.querySelector(".remove").addEventListener("click", () => {
    adapter.remove();
    numberAdapters();
  });
  adapterList.append(adapter);
  numberAdapters();
}

function numberAdapters() {
  numberRows(adapterList, "loras", "lora");
  addAdapter.disabled = adapterList.children.length >= settings.max_loras;
  addAdapter.textContent = adapterList.children.length ? "Stack another adapter" : "Add an adapter";
}

function adapterFields(body) {
  // The stack as the API takes it: each adapter's name and weight, in order (the server checks them).
  const loras = Array.from(adapterList.querySelectorAll(".adapter"), (adapter) => {
    const scale = adapter.querySelector('[data-part="scale"] input').value.trim();
    const parsed = parseFloat(scale);
    const weight = scale === "" ? 1 : Number.isNaN(parsed) ? scale : parsed;  // the server names what is wrong
    return { name: adapter.querySelector("select").value, scale: weight };
  });
  if (loras.length) body.loras = loras;
}

function keyHeaders() {
  const key = keyInput.value.trim();
  if (!settings.api_key) return {};
  sessionStorage.setItem(KEY_STORAGE, key);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function imageSize(file) {
  const bitmap = await createImageBitmap(file);
  const size = [bitmap.width, bitmap.height];
  bitmap.close();
  return size;
}

document.getElementById("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {  // Shift+Enter still starts a new line
    event.preventDefault();
    form.requestSubmit();
  }
});

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  button.disabled = true;
  try {
    const body = fields();
    adapterFields(body);
    if (layered && !layeredFields(body)) return;
    const controls = await controlFields(body.size ?? settings.default_size);
    if (controls) await generate(body, controls);
  } catch (error) {
    showError("", `The request failed: ${error.message}`);
  } finally {
    button.disabled = false;
  }
});

function fields() {
  // progress: omni-ray's per-step events, which OpenAI's API does not have and sends only to callers that ask.
  const body = { stream: true, progress: true, partial_images: PARTIAL_IMAGES, response_format: "b64_json" };
  for (const name of ["prompt", "negative_prompt", "size", "num_inference_steps", "true_cfg_scale", "seed", "n"]) {
    const value = document.getElementById(name).value.trim();
    if (value === "") continue;
    const numeric = ["num_inference_steps", "seed", "n"].includes(name) ? parseInt(value, 10)
      : name === "true_cfg_scale" ? parseFloat(value) : value;
    body[name] = Number.isNaN(numeric) ? value : numeric;  // the server names what is wrong
  }
  return body;
}

function layeredFields(body) {
  // Qwen-Image-Layered's fields, added to the body; false, said beside the field, for layers the input's bounds
  // (the preset's) do not allow: the server would refuse them.
  body.prompt ??= "";  // empty: the server captions the image, and the caption comes back as revised_prompt
  const layers = document.getElementById("layers");
  if (!layers.checkValidity()) {
    showError("layers", `a whole number of layers from ${layered.min_layers} to ${layered.max_layers}`);
    return false;
  }
  if (layers.value !== "") body.layers = parseInt(layers.value, 10);
  body.resolution = parseInt(document.getElementById("resolution").value, 10);
  body.caption_language = document.getElementById("caption_language").value;
  body.cfg_normalize = document.getElementById("cfg_normalize").checked;
  return true;
}

async function controlFields(size) {
  // The controls as the API takes them and their image files, in order; null when one has no image or one of
  // another size than the output (said beside it: the server would refuse it, not resize it).
  const controls = [];
  const files = [];
  const [width, height] = (size === "auto" ? settings.default_size : size).split("x").map(Number);
  for (const [k, control] of Array.from(controlList.querySelectorAll(".control")).entries()) {
    const file = control.querySelector('input[type="file"]').files[0];
    if (!file) {
      showError(`control[${k}].image`, "choose a control image (or remove this ControlNet)");
      return null;
    }
    const [w, h] = await imageSize(file);
    if (width && height && (w !== width || h !== height)) {  // a size the server cannot read: it names `size`
      showError(`control[${k}].image`, `this image is ${w}x${h}, but the output is ${width}x${height}; ` +
        "a control image must be the output's size (or set the size to the image's)");
      return null;
    }
    const entry = { name: control.querySelector("select").value };
    for (const part of ["scale", "start", "end"]) {
      const value = control.querySelector(`[data-part="${part}"] input`).value.trim();
      if (value !== "") entry[part] = Number.isNaN(parseFloat(value)) ? value : parseFloat(value);
    }
    controls.push(entry);
    files.push(file);
  }
  return { controls, files };
}

async function generate(body, { controls, files } = { controls: [], files: [] }) {
  let response;
  const headers = keyHeaders();
  // A form field is text: the adapters' stack goes as JSON text, as the API takes it in a multipart body.
  const formValue = (value) => typeof value === "object" ? JSON.stringify(value) : String(value);
  if (settings.edit) {
    const data = new FormData();
    const field = imageInput.files.length > 1 ? "image[]" : "image";  // as OpenAI's client sends a list
    for (const file of imageInput.files) data.append(field, file);
    for (const [name, value] of Object.entries(body)) data.append(name, formValue(value));
    response = await fetch("/v1/images/edits", { method: "POST", headers, body: data });
  } else if (controls.length) {
    const data = new FormData();
    for (const [name, value] of Object.entries(body)) data.append(name, formValue(value));
    data.append("control", JSON.stringify(controls));  // the images are files, in the controls' order
    for (const file of files) data.append("control_image", file);
    response = await fetch("/v1/images/generations", { method: "POST", headers, body: data });
  } else {
    headers["Content-Type"] = "application/json";
    response = await fetch("/v1/images/generations", { method: "POST", headers, body: JSON.stringify(body) });
  }
  if (!response.ok) {
    const error = (await response.json().catch(() => null))?.error;
    const field = response.status === 401 ? "api_key" : error?.param ?? "";
    showError(field, error?.message ?? `HTTP ${response.status}`);
    return;
  }
  results.replaceChildren();
  const cards = Array.from({ length: body.n ?? 1 }, (_, index) => card(index, body));
  const layerCount = layered ? body.layers ?? layered.default_layers : 0;
  await readEvents(response, (event) => {
    if (event.type === "error") {
      showError(event.error?.param ?? "", event.error?.message ?? "the request failed");
      return;
    }
    // A Layered image's completed events are one per layer, each indexed by its place in `data`.
    const view = cards[event.layer === undefined ? event.index : Math.floor(event.index / layerCount)];
    if (event.type.endsWith(".progress")) {
      view.progress.max = event.total_steps;
      view.progress.value = event.step;
      view.status.textContent = `step ${event.step} of ${event.total_steps}`;
    } else if (event.type.endsWith(".partial_image")) {
      view.image.src = `data:image/${event.output_format};base64,${event.b64_json}`;
      view.image.className = "preview";
      view.image.hidden = false;
      view.status.textContent = `preview ${event.partial_image_index + 1} of ${PARTIAL_IMAGES}`;
    } else if (event.type.endsWith(".completed") && event.layer !== undefined) {
      showLayer(view, event, layerCount);
    } else if (event.type.endsWith(".completed")) {
      const url = `data:image/${event.output_format};base64,${event.b64_json}`;
      view.image.src = url;
      view.image.className = "result";
      view.image.hidden = false;
      view.progress.value = view.progress.max;
      view.download.href = url;
      view.download.hidden = false;
      view.image.onload = () => {
        view.status.textContent = `done, ${view.image.naturalWidth}x${view.image.naturalHeight}`;
      };
    }
  });
}

function card(index, body) {
  const element = document.createElement("article");
  element.className = "card";
  element.dataset.index = String(index);
  const progress = document.createElement("progress");
  progress.max = body.num_inference_steps ?? settings.default_steps;
  progress.value = 0;
  const status = document.createElement("span");
  status.className = "status";
  status.textContent = "waiting";
  const image = document.createElement("img");
  image.alt = `image ${index + 1}`;
  image.hidden = true;
  const download = document.createElement("a");
  download.textContent = "Download";
  download.download = `omni-ray-${body.seed ?? "random"}-${index}.png`;
  download.hidden = true;
  element.append(progress, status, image, download);
  results.append(element);
  const view = { progress, status, image, download };
  if (layered) Object.assign(view, layersView(element));
  return view;
}

function layersView(element) {
  // A Layered image's view: the composite, then each layer bottom to top, all over a checkerboard so transparency
  // shows; the caption that stood for an empty prompt below.
  element.classList.add("layered");
  const layers = document.createElement("div");
  layers.className = "layers";
  layers.hidden = true;
  const figure = document.createElement("figure");
  figure.className = "composite";
  const composite = document.createElement("canvas");
  composite.className = "checker";
  const label = document.createElement("figcaption");
  label.textContent = "Composite";
  figure.append(composite, label);
  layers.append(figure);
  const caption = document.createElement("p");
  caption.className = "caption";
  caption.hidden = true;
  element.append(layers, caption);
  return { layers, composite, caption };
}

async function showLayer(view, event, count) {
  // One layer as it arrives (0: the bottom), in its place; the composite redrawn with every layer decoded so far.
  const url = `data:image/${event.output_format};base64,${event.b64_json}`;
  const figure = document.createElement("figure");
  figure.className = "layer";
  figure.dataset.layer = String(event.layer);
  const image = new Image();
  image.className = "checker result";
  image.alt = `layer ${event.layer + 1}`;
  image.src = url;
  const label = document.createElement("figcaption");
  const place = event.layer === 0 ? " (bottom)" : event.layer === count - 1 ? " (top)" : "";
  label.textContent = `Layer ${event.layer + 1}${place}`;
  const download = document.createElement("a");
  download.textContent = "Download";
  download.href = url;
  download.download = `omni-ray-layer-${event.index}.${event.output_format}`;
  figure.append(image, label, download);
  const above = Array.from(view.layers.querySelectorAll(".layer")).find((f) => Number(f.dataset.layer) > event.layer);
  view.layers.insertBefore(figure, above ?? null);
  view.layers.hidden = false;
  view.image.hidden = true;  // the composite takes the previews' place
  view.progress.value = view.progress.max;
  if (event.revised_prompt) {
    view.caption.textContent = `Caption (the prompt it stood for): ${event.revised_prompt}`;
    view.caption.hidden = false;
  }
  await image.decode();
  const shown = Array.from(view.layers.querySelectorAll(".layer img")).filter((layer) => layer.naturalWidth > 0);
  view.composite.width = shown[0].naturalWidth;  // a canvas is cleared when sized
  view.composite.height = shown[0].naturalHeight;
  const context = view.composite.getContext("2d");
  for (const layer of shown) context.drawImage(layer, 0, 0);  // bottom first
  view.status.textContent = shown.length < count ? `${shown.length} of ${count} layers`
    : `done, ${count} layers of ${image.naturalWidth}x${image.naturalHeight}`;
}

async function readEvents(response, onEvent) {
  // Server-sent events: "data: {json}" blocks separated by a blank line.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("");
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
  }
}

function showError(param, message) {
  const field = document.querySelector(`[data-field="${param}"]`);
  const slot = field?.querySelector(":scope > .error") ?? document.getElementById("error");
  field?.classList.add("invalid");
  slot.textContent = message;
}

function clearErrors() {
  for (const slot of document.querySelectorAll(".error")) slot.textContent = "";
  for (const field of document.querySelectorAll(".invalid")) field.classList.remove("invalid");
}
