#!/usr/bin/env node
// Streams one M* request over gRPC from Node.js: loads proto/mstar/v1/conductor.proto at run
// time (no generated code), lists the served models, calls Conductor.Generate and prints
// every chunk as it arrives, then the final event.
//
//   node client.js [--address 127.0.0.1:50051] [--api-key KEY] [--model toy] [--max-tokens 64] [--timeout 30] [text...]
//
// A mesh with API keys needs one: --api-key, or $MSTAR_API_KEY (sent as metadata "authorization: Bearer KEY").
//
// Output, one line each:  models: toy
//                         chunk text#0 text "U"         (audio/tensor chunks show their byte count)
//                         text: Uryyb, Jbeyq.           (all "text" chunks joined)
//                         final finish_reason=stop prompt_tokens=13 completion_tokens=13 walks=2 audio_seconds=0.13
// A failed call prints "error <STATUS>: <message>" to stderr and exits 1.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const opts = { address: "127.0.0.1:50051", apiKey: process.env.MSTAR_API_KEY || "", model: "toy", maxTokens: null,
    timeout: 30, text: [] };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === "--address") opts.address = value();
    else if (arg === "--api-key") opts.apiKey = value();
    else if (arg === "--model") opts.model = value();
    else if (arg === "--max-tokens") opts.maxTokens = Number(value());
    else if (arg === "--timeout") opts.timeout = Number(value());
    else opts.text.push(arg);
  }
  opts.text = opts.text.length ? opts.text.join(" ") : "Hello, World.";
  return opts;
}

function loadConductor() {
  const protoDir = path.resolve(__dirname, "..", "..", "proto");
  const definition = protoLoader.loadSync(path.join(protoDir, "mstar", "v1", "conductor.proto"), {
    includeDirs: [protoDir],
    keepCase: true, // field names as in the .proto: model_kwargs_json, sample_rate_hz
    longs: String,
    enums: String, // "MODALITY_TEXT"
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).mstar.v1.Conductor;
}

function describe(chunk) {
  const kind = chunk.modality.replace("MODALITY_", "").toLowerCase();
  let payload;
  if (chunk.modality === "MODALITY_TEXT") payload = JSON.stringify(chunk.text);
  else if (chunk.tensor) payload = `${chunk.tensor.datatype}[${chunk.tensor.shape.join(",")}]`;
  else payload = `${chunk.data.length} bytes ${chunk.mime_type} ${chunk.sample_rate_hz} Hz`;
  return `chunk ${chunk.name}#${chunk.index} ${kind} ${payload}`;
}

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const Conductor = loadConductor();
  const client = new Conductor(opts.address, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  if (opts.apiKey) metadata.set("authorization", `Bearer ${opts.apiKey}`);
  const fail = (err) => {
    const status = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || err.code;
    console.error(`error ${status}: ${err.details || err.message}`);
    client.close();
    process.exit(1);
  };

  client.ListModels({}, metadata, { deadline: deadline(10) }, (err, resp) => {
    if (err) return fail(err);
    console.log(`models: ${resp.models.map((m) => m.name).join(", ")}`);
    const kwargs = opts.maxTokens === null ? {} : { max_tokens: opts.maxTokens };
    const call = client.Generate(
      { model: opts.model, text: opts.text, model_kwargs_json: JSON.stringify(kwargs) },
      metadata,
      { deadline: deadline(opts.timeout) },
    );
    const texts = [];
    call.on("data", (msg) => {
      for (const chunk of msg.chunks) {
        console.log(describe(chunk));
        if (chunk.name === "text") texts.push(chunk.text);
      }
      if (msg.final) {
        const u = msg.final.usage;
        console.log(`text: ${texts.join("")}`);
        console.log(`final finish_reason=${msg.final.finish_reason} prompt_tokens=${u.prompt_tokens} ` +
          `completion_tokens=${u.completion_tokens} walks=${u.walks} audio_seconds=${u.audio_seconds}`);
      }
    });
    call.on("error", fail);
    call.on("end", () => client.close());
  });
}

main();
