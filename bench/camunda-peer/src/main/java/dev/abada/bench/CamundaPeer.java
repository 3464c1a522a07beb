package dev.abada.bench;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import org.camunda.bpm.client.ExternalTaskClient;
import org.camunda.bpm.client.task.ExternalTaskHandler;

/**
 * The peer of the Abada agent worker in BENCHMARKS.md's comparison: a Camunda 7 external task
 * client written as its documentation shows (docs.camunda.org/manual/7.23/user-guide/ext-client/),
 * doing what the worker does for a one-turn agent task: one chat-completions call to the model,
 * then complete the task with the answer as the result variable.
 *
 * <pre>
 * java -cp 'target/camunda-peer-0.1.0.jar:target/lib/*' dev.abada.bench.CamundaPeer \
 *     BASE_URL MODEL_BASE_URL TOPIC MODE [MAX_TASKS]
 * </pre>
 *
 * MODE {@code sequential}: one client, {@code maxTasks} 8 (the worker's slots), the client's
 * documentation's {@code asyncResponseTimeout} of 10 s (long polling), the client's defaults
 * otherwise (lockDuration 20 s, exponential back-off on empty answers, handlers run one
 * after the other on the client's single thread). MODE {@code clients}: the maintainers' answer to
 * "parallel task execution" (github.com/camunda/camunda-external-task-client-java/issues/16): several clients of
 * {@code maxTasks} 1 with long polling, here 8 clients in one JVM, each with its own thread.
 */
public final class CamundaPeer {

  private static final ObjectMapper JSON = new ObjectMapper();
  private static final HttpClient HTTP =
      HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();

  private CamundaPeer() {}

  public static void main(String[] args) throws InterruptedException {
    if (args.length < 4) {
      System.err.println("usage: CamundaPeer BASE_URL MODEL_BASE_URL TOPIC sequential|clients [MAX_TASKS]");
      System.exit(2);
    }
    String baseUrl = args[0];
    String modelUrl = args[1] + "/chat/completions";
    String topic = args[2];
    String mode = args[3];
    int slots = args.length > 4 ? Integer.parseInt(args[4]) : 8;

    ExternalTaskHandler handler = (task, service) -> {
      String input = task.getVariable("orderId");
      try {
        ObjectNode body = JSON.createObjectNode();
        body.put("model", "bench");
        body.putArray("messages")
            .add(JSON.createObjectNode()
                .put("role", "system")
                .put("content", "You answer benchmark requests with JSON."))
            .add(JSON.createObjectNode().put("role", "user").put("content", input));
        HttpRequest request = HttpRequest.newBuilder(URI.create(modelUrl))
            .timeout(Duration.ofSeconds(60))
            .header("content-type", "application/json")
            .POST(HttpRequest.BodyPublishers.ofString(JSON.writeValueAsString(body)))
            .build();
        HttpResponse<String> response = HTTP.send(request, HttpResponse.BodyHandlers.ofString());
        if (response.statusCode() != 200) {
          throw new IllegalStateException("the model answered " + response.statusCode());
        }
        JsonNode answer = JSON.readTree(response.body());
        String content = answer.path("choices").path(0).path("message").path("content").asText();
        service.complete(task, Map.of("agentResult", content));
      } catch (Exception e) {
        int retries = task.getRetries() == null ? 3 : task.getRetries();
        service.handleFailure(task, e.getMessage(), e.toString(), Math.max(retries - 1, 0), 1000);
      }
    };

    List<ExternalTaskClient> clients = new ArrayList<>();
    if (mode.equals("sequential")) {
      clients.add(ExternalTaskClient.create()
          .baseUrl(baseUrl)
          .workerId("camunda-peer")
          .maxTasks(slots)
          .asyncResponseTimeout(10_000) // long polling, as the documentation's example does
          .build());
    } else if (mode.equals("clients")) {
      for (int i = 1; i <= slots; i++) {
        clients.add(ExternalTaskClient.create()
            .baseUrl(baseUrl)
            .workerId("camunda-peer-" + i)
            .maxTasks(1)
            .asyncResponseTimeout(10_000)
            .build());
      }
    } else {
      System.err.println("MODE is sequential or clients, not " + mode);
      System.exit(2);
    }
    for (ExternalTaskClient client : clients) {
      client.subscribe(topic).handler(handler).open();
    }
    Runtime.getRuntime().addShutdownHook(new Thread(() -> clients.forEach(ExternalTaskClient::stop)));
    new CountDownLatch(1).await();
  }
}
