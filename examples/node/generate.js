// Stream a completion from a splitserve frontend, using only the .proto files (no generated code).
//
//   cd examples/node && npm install                      # @grpc/grpc-js and @grpc/proto-loader (package.json)
//   node generate.js localhost:50051 "The capital of France is" 32   # or: npm start -- ADDRESS PROMPT MAX_TOKENS
//
// Prints one JSON line per streamed message: {"text", "tokenIds", "finished", "finishReason"}.
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address = "localhost:50051", prompt = "Hello", maxTokens = "32"] = process.argv.slice(2);
const protoRoot = path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync("splitserve/frontend/v1/generation.proto", {
  includeDirs: [protoRoot],
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
});
const { Generation } = grpc.loadPackageDefinition(definition).splitserve.frontend.v1;
const client = new Generation(address, grpc.credentials.createInsecure());

const call = client.Generate({
  prompt,
  samplingParams: { maxTokens: Number(maxTokens), temperature: 0, ignoreEos: true, outputKind: "OUTPUT_KIND_DELTA" },
});
call.on("data", (response) => {
  const output = response.outputs[0];
  console.log(JSON.stringify({
    text: output.text,
    tokenIds: output.tokenIds,
    finished: response.finished,
    finishReason: output.finishReason,
  }));
});
call.on("error", (error) => {
  console.error(`${error.code} ${error.details}`);
  process.exit(1);
});
call.on("end", () => client.close());
